import pytest

from kiln.serve.scheduler import Scheduler


@pytest.fixture
def scheduler_for():
    """make(model, tokenizer=None, **kwargs): a Scheduler, closed when the test ends."""
    made = []

    def make(model, tokenizer=None, **kwargs):
        made.append(Scheduler(model, tokenizer, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()
