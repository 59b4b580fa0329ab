"""`python recipes/ablation.py` end to end on a tiny model (runs, table, plot, resume), and its planning and
pairing without training."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from recipe_helpers import ROOT, TRAIN_CONLL, env, ner_files

import ablation


# The whole runner end to end (6 runs and a resume: about a minute on 2 cores) is a slow test; the default run keeps
# its parts: the plan, the pairing, the summary, reuse of finished runs (below) and the executor (tests/test_sweep.py).
@pytest.mark.slow
def test_ablation_tiny_ner(tiny_model, tmp_path):
    out = tmp_path / "abl"
    command = [
        sys.executable, str(ROOT / "recipes" / "ablation.py"), "--recipe", "ner", "--seeds", "2", "--max_steps", "2",
        "--jobs", "2", "--configurations", "baseline,fgm", "--output_dir", str(out), "--",
        "--model_name_or_path", tiny_model, *ner_files(tmp_path), "--per_device_train_batch_size", "2",
        "--disable_tqdm", "true", "--logging_steps", "1",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / "ablation.md").read_text()
    for config in ("baseline", "fgm"):
        assert f"| {config} |" in table
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "ablation.json").read_text())
    rows = {r["configuration"]: r for r in data["rows"]}
    # The table's numbers are those the runs reported: the mean of the two seeds' test_f1, recomputed from their
    # prediction files (one test split: nothing to pool).
    f1s = [by_fold["null"]["results"]["test_f1"] for by_fold in data["runs"]["fgm"]["default"].values()]
    assert abs(rows["fgm"]["same_lr"][0] - sum(f1s) / 2) < 1e-9
    assert rows["baseline"]["time_vs_baseline"] == 1.0
    assert rows["baseline"]["difference"]["value"] == 0.0
    # Two seeds: the interval covers seeds and examples, and the yardstick (the baseline with seeds 3 and 4, paired
    # with 1 and 2) is a row.
    assert "Interval: 95% interval over seeds and examples" in table and data["interval"] == "seeds and examples"
    assert "| yardstick: baseline, seed 3, 4 |" in table
    assert sorted(data["runs"]["yardstick"]["default"]) == ["3", "4"]
    assert (out / "baseline" / "lrdefault" / "seed4" / "all_results.json").is_file()
    # The trivial baseline is a row, run on the same split.
    assert "| gazetteer |" in table and rows["gazetteer"]["examples"] == rows["baseline"]["examples"] == 2
    # The FGM runs really trained adversarially (their logs carry the adversarial loss).
    state = json.loads((out / "fgm" / "lrdefault" / "seed1" / "trainer_state.json").read_text())
    assert any("loss_adv" in e for e in state["log_history"])
    # Resume: a second call reruns nothing.
    again = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "[ablation] " not in again.stdout


@pytest.mark.slow
def test_ablation_folds_predict_every_example_once(tiny_model, tmp_path):
    (tmp_path / "train.conll").write_text(TRAIN_CONLL + "\nMary B-PER\nsat O\n\nthe O\ndog O\nran O\n")
    out = tmp_path / "cv"
    command = [
        sys.executable, str(ROOT / "recipes" / "ablation.py"), "--recipe", "ner", "--seeds", "1", "--folds", "2",
        "--max_steps", "1", "--configurations", "baseline", "--jobs", "2", "--resamples", "200", "--no_yardstick",
        "--output_dir", str(out), "--",
        "--model_name_or_path", tiny_model, "--train_file", str(tmp_path / "train.conll"),
        "--per_device_train_batch_size", "2", "--disable_tqdm", "true",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "ablation.json").read_text())
    rows = {r["configuration"]: r for r in data["rows"]}
    # 5 sentences, 2 folds: each one is in exactly one test fold, so the pooled predictions hold all 5.
    assert rows["baseline"]["examples"] == rows["gazetteer"]["examples"] == 5
    tests = [by_fold[str(k)]["results"]["test_samples"] for by_fold in data["runs"]["baseline"]["default"].values()
             for k in range(2)]  # fmt: skip
    assert sorted(tests) == [2, 3]
    table = (out / "ablation.md").read_text()
    assert "pooled test predictions of 2 folds" in table and "| yardstick" not in table
    assert "over examples only (one seed" in table


def test_ablation_refuses_multi_label_classification(tmp_path, capsys):
    """The per-example bootstrap and the TF-IDF baseline score single labels: a multi-label ablation is one line."""
    with pytest.raises(SystemExit) as exit_info:
        ablation.main(["--recipe", "classification", "--output_dir", str(tmp_path), "--", "--multi_label", "true"])
    assert exit_info.value.code == 2
    assert "--multi_label" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing ran
    cases = {
        ("--multi_label",): True,
        ("--multi_label", "--seed", "1"): True,
        ("--multi-label", "true"): True,
        ("--multi_label=True",): True,
        ("--multi_label", "false"): False,
        ("--multi_label=no",): False,
        ("--max_train_samples", "50"): False,
    }
    for flags, expected in cases.items():
        assert ablation.multi_label_requested(list(flags)) is expected, flags


def test_plan_runs_pairs_every_configuration_with_the_baseline_by_seed_and_fold(tmp_path):
    """No training: the plan gives every configuration (and the yardstick) the baseline's learning rates, seeds and
    folds, with the baseline's flags plus its own, written out here."""
    configs = {"baseline": [], "fgm": ["--adversarial", "fgm"], "crf": ["--crf", "true"]}
    plan = ablation.plan_runs(
        "ner.py",
        configs,
        ["1e-4", "3e-4"],
        3,
        5,
        tmp_path,
        ["--num_train_epochs", "1"],
        trivial_baselines=["gazetteer"],
    )
    runs = {(r.configuration, r.lr, r.seed, r.fold): r for r in plan}
    assert len(runs) == len(plan)  # one run per configuration, lr, seed and fold
    for lr, seed, fold in itertools.product(["1e-4", "3e-4"], range(1, 4), range(5)):
        common = ["--num_train_epochs", "1", "--learning_rate", lr, "--num_folds", "5", "--fold", str(fold)]
        for config, config_flags in configs.items():
            run = runs.pop((config, lr, seed, fold))
            assert run.flags == ["--seed", str(seed), *config_flags, *common]
            assert run.run_dir == tmp_path / config / f"lr{lr}" / f"seed{seed}" / f"fold{fold}"
        # The yardstick: the baseline's flags with seed + 3 (4, 5, 6), in the baseline's folder.
        yardstick = runs.pop(("yardstick", lr, seed + 3, fold))
        assert yardstick.flags == ["--seed", str(seed + 3), *common]
        assert yardstick.run_dir == tmp_path / "baseline" / f"lr{lr}" / f"seed{seed + 3}" / f"fold{fold}"
    # The trivial baseline: deterministic, once per fold; nothing else was planned.
    assert sorted(runs) == [("gazetteer", "-", 1, fold) for fold in range(5)]
    assert len({r.run_dir for r in plan}) == len(plan)
    # plain_flags (the ablation's --tricks none) go into every model run, right after the seed; not the gazetteer's.
    plain = ablation.plan_runs("ner.py", configs, ["default"], 1, None, tmp_path, trivial_baselines=["gazetteer"],
                               plain_flags=["--tricks", "none"])  # fmt: skip
    assert {tuple(r.flags[:4]) for r in plain if r.configuration != "gazetteer"} == {
        ("--seed", "1", "--tricks", "none"),
        ("--seed", "2", "--tricks", "none"),
    }
    assert [r.flags for r in plain if r.configuration == "gazetteer"] == [["--baseline", "gazetteer"]]
    assert not [r for r in ablation.plan_runs("ner.py", configs, ["default"], 2, None, tmp_path, yardstick=False)
                if r.configuration == "yardstick"]  # fmt: skip


def _write_predictions(folder, gold, predicted):
    folder.mkdir(parents=True)
    lines = ["label,predicted,text"] + [f"{g},{p},text {i}" for i, (g, p) in enumerate(zip(gold, predicted))]
    (folder / "test_predictions.csv").write_text("\n".join(lines) + "\n")
    return {"run_dir": str(folder), "results": {"eval_f1": 0.5}, "train_seconds_per_step": 1.0, "peak_memory_mb": 1.0}


def test_summarize_pairs_seeds_in_order_and_names_its_interval(tmp_path):
    """Made-up predictions of 60 texts (no training): the difference is the mean of the per-seed macro-F1
    differences (scikit-learn's f1_score), seed s of a configuration against seed s of the baseline, and the table
    names the interval it used: over seeds and examples from two seeds on, examples only with one."""
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(0)
    gold = rng.choice(["business", "sport", "tech"], 60)

    def noisy(right_share):
        return np.where(rng.uniform(size=60) < right_share, gold, rng.choice(["business", "sport", "tech"], 60))

    predictions = {
        ("baseline", 1): noisy(0.6), ("baseline", 2): noisy(0.7), ("focal", 1): noisy(0.8),
        ("focal", 2): noisy(0.9), ("yardstick", 3): noisy(0.65), ("yardstick", 4): noisy(0.7),
    }  # fmt: skip
    runs = {}
    for (config, seed), predicted in predictions.items():
        record = _write_predictions(tmp_path / config / str(seed), gold, predicted)
        runs.setdefault(config, {}).setdefault("default", {}).setdefault(seed, {})[None] = record
    table = {r["configuration"]: r for r in ablation.summarize(runs, "classification", "f1", ["default"], 200)}

    def f1(config, seed):
        return f1_score(gold, predictions[(config, seed)], average="macro")

    for config, seeds in (("focal", (1, 2)), ("yardstick", (3, 4))):
        expected = np.mean([f1(config, s) - f1("baseline", b) for s, b in zip(seeds, (1, 2))])
        assert table[config]["difference"]["value"] == pytest.approx(expected)
        assert table[config]["difference"]["interval"] == "seeds and examples"
    ablation.write_markdown(list(table.values()), "f1", ["default"], 2, None, tmp_path / "two.md")
    text = (tmp_path / "two.md").read_text()
    assert "Interval: 95% interval over seeds and examples" in text
    assert "| yardstick: baseline, seed 3, 4 |" in text

    one_seed = {config: {"default": {1: by_lr["default"][min(by_lr["default"])]}} for config, by_lr in runs.items()}
    rows = ablation.summarize(one_seed, "classification", "f1", ["default"], 200)
    focal = next(r for r in rows if r["configuration"] == "focal")
    assert focal["difference"]["value"] == pytest.approx(f1("focal", 1) - f1("baseline", 1))
    assert focal["difference"]["interval"] == "examples only"
    ablation.write_markdown(rows, "f1", ["default"], 1, None, tmp_path / "one.md")
    assert "over examples only (one seed: it does not cover training randomness" in (tmp_path / "one.md").read_text()


def test_dry_run_lists_the_runs_and_starts_none(tmp_path, capsys):
    out = tmp_path / "abl"
    argv = ["--recipe", "ner", "--folds", "2", "--seeds", "2", "--configurations", "baseline,focal", "--output_dir",
            str(out), "--add_configuration", "awp_late=--adversarial awp --adv_start_step 3", "--dry_run"]  # fmt: skip
    assert ablation.main(argv) == 0
    printed = capsys.readouterr().out
    # 3 configurations and the yardstick, 2 seeds, 2 folds; the gazetteer once per fold.
    assert "[ablation] 18 runs planned, 0 finished, 18 to run" in printed
    assert "--seed 1 --tricks none --adversarial awp --adv_start_step 3 --num_folds 2 --fold 1" in printed
    assert not out.exists()
    with pytest.raises(SystemExit) as exit_info:
        ablation.main(["--recipe", "ner", "--output_dir", str(out), "--add_configuration", "late", "--dry_run"])
    assert exit_info.value.code == 2 and "NAME=FLAGS" in capsys.readouterr().err


def test_run_one_reuses_a_run_finished_with_the_same_flags_only(tmp_path, capsys):
    """Resume without training: a stand-in script writes its flags as results; a finished run with the same flags is
    returned as it is, one with other flags runs again (and --dry_run counts them the same way)."""
    script = tmp_path / "stand_in.py"
    script.write_text(
        "import json, sys\nout = sys.argv[sys.argv.index('--output_dir') + 1]\n"
        "json.dump({'flags': sys.argv[1:]}, open(out + '/all_results.json', 'w'))\n"
    )
    run_dir = tmp_path / "run"
    first = ablation.run_one(str(script), run_dir, ["--seed", "1"])
    assert "--seed" in first["results"]["flags"] and ablation.finished_record(run_dir, ["--seed", "1"]) == first
    capsys.readouterr()
    assert ablation.run_one(str(script), run_dir, ["--seed", "1"]) == first
    assert "[ablation]" not in capsys.readouterr().out  # nothing ran
    assert ablation.finished_record(run_dir, ["--seed", "2"]) is None
    second = ablation.run_one(str(script), run_dir, ["--seed", "2"])
    assert "finished with other flags" in capsys.readouterr().out
    assert second["flags"] == ["--seed", "2"] and second["results"]["flags"][-1] == "2"
