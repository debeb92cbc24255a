"""bench/post_seeds.py's table: held-out accuracy per post stage, and the pretrain stage's final
validation loss per seed, the whole table for a recipe that stops at pretraining (tiny-bert)."""

from post_seeds import print_table


def _row(seed: int, loss: float, bpb: float | None, chain: list[dict]) -> dict:
    pretrain = {"final_val_loss": loss, "final_val_bpb": bpb, "train_s": 140.0 + seed % 10}
    return {"label": "muon", "seed": seed, "overrides": [], "seconds": 150.0, "pretrain": pretrain, "chain": chain}


def test_a_pretrain_only_recipe_gets_its_losses_and_their_spread(capsys):
    print_table([_row(1337, 6.314, None, []), _row(1338, 6.326, None, []), _row(1339, 6.322, None, [])])
    out = capsys.readouterr().out
    assert "  1338     6.326        -      148" in out  # no bits per byte: a masked-token loss
    assert "  mean     6.321   min 6.314 max 6.326 std 0.006" in out
    assert "accuracy mean" not in out  # no post stages, no accuracy rows


def test_post_stages_and_pretraining_side_by_side(capsys):
    sft = [{"stage": "sft", "before": 0.0, "after": 0.85}]
    rows = [_row(1337, 2.60, 1.15, sft), _row(1338, 2.62, 1.16, [{**sft[0], "after": 0.90}])]
    rows.append({**_row(1339, 0.0, None, sft), "pretrain": None})  # a row from before the bench kept them
    print_table(rows)
    out = capsys.readouterr().out
    assert "sft: raised accuracy over the stage before it in 3 of 3 seeds" in out
    assert "  1337     2.600    1.150      147" in out
    assert "  mean     2.610   min 2.600 max 2.620 std 0.014" in out  # the older row left out
