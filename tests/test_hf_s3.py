"""HF export from and to S3 (a moto server on 127.0.0.1): transformers loads the uploaded folder."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kiln_testing.models import randomise  # noqa: E402
from kiln_testing.tokenizer import train_byte_bpe  # noqa: E402

from kiln import storage  # noqa: E402
from kiln.checkpoint import save_weights  # noqa: E402
from kiln.hf import export_checkpoint_to_hf  # noqa: E402
from kiln.model import ModelConfig, build_model  # noqa: E402


@pytest.mark.slow  # transformers import and model load (~18 s on 2 shared cores)
def test_export_s3_checkpoint_to_s3_folder(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    train_byte_bpe(tmp_path / "tokenizer.json", ["hello world, a tiny text"] * 5, vocab_size=320)
    cfg = ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    model = randomise(build_model(cfg)).eval()
    save_weights(tmp_path / "w", cfg, model.state_dict(), {"step": 7})
    for path in (tmp_path / "w").iterdir():
        storage.upload(path, f"{s3_bucket}/ckpt/{path.name}")
    order = []
    real = storage.upload
    monkeypatch.setattr(storage, "upload", lambda path, url: (order.append(storage.name_of(url)), real(path, url)))
    out = export_checkpoint_to_hf(f"{s3_bucket}/ckpt", tmp_path / "tokenizer.json", f"{s3_bucket}/hf")
    assert out == f"{s3_bucket}/hf" and order[-1] == "config.json" and "model.safetensors" in order
    storage.filesystem(out).get(f"{out}/", str(tmp_path / "hf"), recursive=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens).float(), rtol=1e-4, atol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("hello")["input_ids"]
