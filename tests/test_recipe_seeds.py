"""dev/recipes/recipe_seeds.py's arithmetic: which feature a seed counts, its margins, the claim."""

import importlib.util
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parents[1] / "dev" / "recipes"
PIXELS = {"logistic regression": 96.67, "RBF-SVM": 98.89}


@pytest.fixture(scope="module")
def recipe_seeds():
    sys.path.insert(0, str(DEV))
    spec = importlib.util.spec_from_file_location("recipe_seeds", DEV / "recipe_seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(seed, top1, cv):
    return {
        "seed": seed,
        "top1": dict(zip(["s2", "s3", "avgpool"], top1)),
        "cv_top1": dict(zip(["s2", "s3", "avgpool"], cv)),
    }


def test_the_counted_feature_is_chosen_by_cross_validation_not_by_val(recipe_seeds):
    # val says avgpool, cross-validation on TRAIN says s3: s3 counts
    assert recipe_seeds.chosen_feature(_record(0, [97.0, 97.5, 99.0], [97.9, 98.3, 98.1])) == "s3"
    # a tie goes to the first listed; a head without a cross-validated score never wins
    assert recipe_seeds.chosen_feature(_record(0, [97.0, 97.5, 99.0], [98.0, 98.0, None])) == "s2"
    row = recipe_seeds.seed_row(
        {**_record(0, [97.0, 97.5, 99.0], [97.9, 98.3, 98.1]), "seconds": {"pretrain": 1, "linear_eval": 2}},
        PIXELS,
    )
    assert row["chosen"] == 97.5
    assert row["vs logistic"] == pytest.approx(0.83) and row["vs RBF-SVM"] == pytest.approx(-1.39)


def test_the_random_control_counts_the_feature_its_own_cross_validation_picks(recipe_seeds):
    # the untrained trunk's probe picks avgpool (its best on TRAIN), not the pretrained run's s3
    record = {
        **_record(0, [97.0, 97.5, 99.0], [97.9, 98.3, 98.1]),
        "random": _record(0, [96.0, 95.0, 94.0], [90.0, 91.0, 92.0]),
        "seconds": {"pretrain": 1, "linear_eval": 2},
    }
    row = recipe_seeds.seed_row(record, PIXELS)
    assert row["random chosen"] == 94.0 and row["vs random"] == pytest.approx(3.5)
    without_control = {key: value for key, value in record.items() if key != "random"}
    assert "random chosen" not in recipe_seeds.seed_row(without_control, PIXELS)


def test_the_claim_needs_every_seed_above_the_pixels_and_the_mean_margin(recipe_seeds):
    good = [_record(s, [98.0, 99.0, 99.0], [97.0, 98.0, 97.0]) for s in range(5)]
    assert recipe_seeds.claim(good, PIXELS, 1.0) == (True, [pytest.approx(2.33)] * 5)
    # one seed at the pixel baseline (a tie is not above it) fails, whatever the mean
    tie = good[:4] + [_record(4, [96.67, 99.0, 99.0], [98.0, 97.0, 97.0])]
    holds, margins = recipe_seeds.claim(tie, PIXELS, 1.0)
    assert not holds and margins[-1] == pytest.approx(0.0)
    # every seed above, the mean below the required margin
    small = [_record(s, [97.0, 97.0, 97.0], [98.0, 97.0, 97.0]) for s in range(5)]
    assert recipe_seeds.claim(small, PIXELS, 0.5)[0] is False
    assert recipe_seeds.claim(small, PIXELS, 0.3)[0] is True


def test_reusing_pretraining_takes_the_earlier_runs_trunk_and_times_and_refuses_another_recipe(
    recipe_seeds, tmp_path
):
    import json
    from types import SimpleNamespace

    earlier = tmp_path / "earlier" / "seed_3"
    earlier.mkdir(parents=True)
    recipe = {"pretrain_overrides": ["config.OPTIMIZER.num_epochs=40"], "eval_overrides": []}
    record = {
        **recipe,
        "seconds": {"pretrain": 900.0, "linear_eval": 1.0},
        "cpu_per_rank": {"pretrain": 287.0},
    }
    (earlier / "result.json").write_text(json.dumps(record))
    args = SimpleNamespace(reuse_pretraining=str(tmp_path / "earlier"))
    timings, cpu = {}, {}
    assert recipe_seeds.reused_pretraining(args, 3, recipe, timings, cpu) == earlier / "pretrain"
    assert timings == {"seed 3 pretrain": 900.0} and cpu == {"pretrain": 574.0}  # CPU of both ranks

    other = {"pretrain_overrides": [], "eval_overrides": []}
    with pytest.raises(SystemExit, match="pass the same --pretrain"):
        recipe_seeds.reused_pretraining(args, 3, other, {}, {})
    with pytest.raises(SystemExit, match="needs a finished seed 4 there"):
        recipe_seeds.reused_pretraining(args, 4, recipe, {}, {})


def test_the_table_prints_the_standard_error_beside_the_std(recipe_seeds, capsys):
    from types import SimpleNamespace

    records = [
        {
            **_record(s, [97.0 + s, 98.0, 99.0], [98.0, 97.0, 97.0]),
            "seconds": {"pretrain": 10, "linear_eval": 2},
            "cpu_per_rank": {"pretrain": 9, "linear_eval": 1},
            "lr": {"s2": 0.1, "s3": 0.1, "avgpool": 0.1},
        }
        for s in range(4)
    ]
    stats = recipe_seeds.print_table(
        SimpleNamespace(method="SimCLR", pretrain=[], eval=[], eval_config=""), records, PIXELS
    )
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| mean")}
    # s2 (chosen) over the seeds: 97, 98, 99, 100: mean 98.5, sample std 1.29, standard error 1.29 / 2
    assert stats["s2"] == (pytest.approx(98.5), pytest.approx(1.2910, abs=1e-4))
    assert "| 98.50 ± 1.29 |" in rows["| mean ± std"] and "| 98.50 ± 0.65 |" in rows["| mean ± s.e."]
