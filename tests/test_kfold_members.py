"""`recipes/kfold.py`'s members and what is built from them: fold models trained for the single model's steps with
their own seeds and (``--fold_select best``) their best checkpoint, full-fit seeds, soups, decision rules fitted on
out-of-fold rows only, a teacher of another architecture and tokenizer, and a member with other labels refused.

One k-fold classification run with every option (``run``, built once) is checked by several tests, each against a
reference computed here: the Trainer's own step count, the checkpoint the log says is best, the mean of the kept
members' weights, scipy's minimum of the log loss, the teacher's own forward pass."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_kfold import CLS_TEST, CLS_TRAIN, read_csv_rows, run_here, sklearn_scores

from recipe_helpers import make_tiny_causal_model, run_in_process, write_csv

import kfold
from ensemble_folder import TASKS, write_manifest
from kfold_plan import member_seed, training_steps

LABELS = ["animal", "work"]
CLS_VALIDATION = [("a dog ran on the mat", "animal"), ("john works at acme", "work"), ("mary works", "work")]


def flags(model: str, *extra: str) -> list[str]:
    """A tiny run given in epochs (no --max_steps): one epoch at batch size 4."""
    return [
        "--model_name_or_path",
        model,
        "--num_train_epochs",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--learning_rate",
        "1e-3",
        "--disable_tqdm",
        "true",
        "--seed",
        "0",
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        *extra,
    ]


def predict_through(recipe: str, model: str, test_file: str, out: Path, monkeypatch, *extra: str, batch="4") -> Path:
    """``recipes/<recipe>.py`` predicting ``test_file`` with ``model`` (a model or ensemble folder) into ``out``."""
    args = ["--model_name_or_path", model, "--do_train", "false", "--test_file", test_file, "--output_dir", str(out),
            "--per_device_eval_batch_size", batch, *extra]  # fmt: skip
    assert run_in_process(recipe, args, monkeypatch) == 0
    return out


def llama_classifier(path: Path, labels: list[str]) -> Path:
    """An untrained tiny Llama sequence classifier over ``labels`` with its own WordLevel tokenizer: another
    architecture and tokenizer than the BERT students."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    lm = make_tiny_causal_model(path.with_name(path.name + "_lm"), "llama")
    torch.manual_seed(3)
    model = LlamaForSequenceClassification.from_pretrained(
        lm,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={k: i for i, k in enumerate(labels)},
        pad_token_id=0,
    )
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # logits far enough from uniform to tell targets apart
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(lm).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """One classification run: 2 folds in epochs matched to the single model, best checkpoints, 2 full-fit seeds,
    a greedy soup of the folds selected on a validation file, temperature and bias rules, a student of a Llama
    teacher."""
    tmp = tmp_path_factory.mktemp("members")
    for name, rows in (("train", CLS_TRAIN), ("test", CLS_TEST), ("validation", CLS_VALIDATION)):
        write_csv(tmp / f"{name}.csv", rows)
    teacher = llama_classifier(tmp / "teacher", LABELS)
    out = tmp / "kf"
    data = [
        "--train_file",
        str(tmp / "train.csv"),
        "--test_file",
        str(tmp / "test.csv"),
        "--validation_file",
        str(tmp / "validation.csv"),
    ]
    argv = [
        "--recipe",
        "classification",
        "--folds",
        "2",
        "--output_dir",
        str(out),
        "--fold_select",
        "best",
        "--full_fit_seeds",
        "2",
        "--soup",
        "greedy",
        "--fit_rule",
        "temperature",
        "bias",
        "--distill",
        "true",
        "--teacher",
        str(teacher),
        "--",
        *flags(tiny_model),
        *data,
    ]
    assert kfold.main(argv, run=run_here) == 0
    # The single model: the recipe itself on all the training data, the same flags.
    single = tmp / "single"
    record = run_here(
        kfold.FoldJob(
            0,
            0,
            str(kfold.TASKS["classification"].recipe.__file__),
            single,
            [*flags(tiny_model), "--train_file", str(tmp / "train.csv"), "--test_file", str(tmp / "test.csv")],
        )
    )
    return {
        "out": out,
        "tmp": tmp,
        "teacher": teacher,
        "single": single,
        "single_record": record,
        "results": json.loads((out / "all_results.json").read_text()),
    }


def global_step(folder: Path) -> int:
    return json.loads((folder / "trainer_state.json").read_text())["global_step"]


def flag_value(folder: Path, name: str) -> str:
    recorded = json.loads((folder / "ablation_run.json").read_text())["flags"]
    return recorded[len(recorded) - 1 - recorded[::-1].index(name) + 1]  # the last one, as argparse reads it


def test_every_member_trains_the_single_models_steps_with_its_own_seed(run):
    out, single = run["out"], run["single"]
    steps = global_step(single)  # the Trainer's own count on all the training data
    assert steps == 3  # 11 examples, batches of 4, one epoch
    members = [out / "fold0", out / "fold1", out / "full_fit" / "seed0", out / "full_fit" / "seed1"]
    for member in members:
        assert global_step(member) == steps, member  # a fold's epoch would be 2 steps (5-6 examples)
    seeds = [int(flag_value(m, "--seed")) for m in members]
    assert seeds == [
        member_seed(0, "fold", 0),
        member_seed(0, "fold", 1),
        member_seed(0, "full_fit", 0),
        member_seed(0, "full_fit", 1),
    ]
    assert len(set(seeds + [0])) == 5
    assert run["results"]["fold_max_steps"] == [3, 3] and run["results"]["full_fit_max_steps"] == 3


@pytest.mark.parametrize(
    "examples, settings",
    [
        (11, {}),
        (11, {"gradient_accumulation_steps": 2}),
        (10, {"num_train_epochs": 1.5}),
        (9, {"dataloader_drop_last": True}),
        (9, {"max_steps": 4}),
    ],
)
def test_training_steps_count_as_the_trainer_does(tmp_path, examples, settings):
    """The step count the runner passes to every member, against a Trainer run of that many examples."""
    from transformers import Trainer, TrainingArguments

    from tiny import bert_seq_cls, seq_cls_data

    settings = {"per_device_train_batch_size": 4, "num_train_epochs": 1, **settings}
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, **settings)
    trainer = Trainer(model=bert_seq_cls(), args=args, train_dataset=seq_cls_data(n=examples))
    trainer.train()
    assert training_steps(args, examples) == trainer.state.global_step


def test_fold_select_best_keeps_the_checkpoint_its_held_out_fold_scores_best(run):
    for k in range(2):
        folder = run["out"] / f"fold{k}"
        state = json.loads((folder / "trainer_state.json").read_text())
        evals = {e["step"]: e["eval_f1"] for e in state["log_history"] if "eval_f1" in e}
        assert len(evals) >= 2  # an evaluation per epoch of the fold's data, on its held-out part
        best_step = max(evals, key=lambda step: (evals[step], -step))  # the first best, as Trainer keeps it
        assert state["best_metric"] == evals[best_step]
        assert state["best_model_checkpoint"].endswith(f"checkpoint-{best_step}")
        best = load_file(Path(state["best_model_checkpoint"]) / "model.safetensors")
        final = load_file(folder / "model.safetensors")
        assert all(torch.equal(best[key], final[key]) for key in best)
    assert run["results"]["fold_select"] == "best"


def test_full_fit_seeds_are_an_ensemble_folder_that_predicts_through_the_recipe(run, monkeypatch):
    out, tmp = run["out"], run["tmp"]
    folder = out / "full_fit"
    rows = read_csv_rows(folder / "test_predictions.csv")
    probabilities = [np.load(folder / f"seed{k}" / "test_probabilities.npy") for k in range(2)]
    np.testing.assert_allclose(np.load(folder / "test_probabilities.npy"), sum(probabilities) / 2, rtol=1e-6)
    assert [r["predicted"] for r in rows] == [LABELS[j] for j in (probabilities[0] + probabilities[1]).argmax(1)]
    for key, value in sklearn_scores(rows, LABELS).items():
        assert run["results"][f"full_fit_test_{key}"] == pytest.approx(value, abs=1e-12)
    predicted = predict_through(
        "classification", str(folder), str(tmp / "test.csv"), tmp / "predicted_full_fit", monkeypatch, batch="4"
    )
    assert read_csv_rows(predicted / "test_predictions.csv") == rows


def test_greedy_soup_is_the_mean_of_the_kept_members_and_predicts_as_one_model(run, monkeypatch):
    out, tmp = run["out"], run["tmp"]
    for folder, members in ((out / "soup", ["fold0", "fold1"]),):
        info = json.loads((folder / "soup.json").read_text())
        assert info["selection"].startswith("validation") and info["selection_score"] >= max(info["member_scores"])
        assert info["kept"][0] == members[int(np.argmax(info["member_scores"]))]  # the best member starts the soup
        states = [load_file(folder.parent / name / "model.safetensors") for name in info["kept"]]
        soup = load_file(folder / "model.safetensors")
        for key, value in soup.items():
            want = (sum(s[key].double() for s in states) / len(states)).to(value.dtype)
            torch.testing.assert_close(value, want, rtol=0, atol=1e-7)  # float64 sums, rounded once
    predicted = predict_through(
        "classification",
        str(out / "soup"),
        str(tmp / "test.csv"),
        tmp / "predicted_soup",
        monkeypatch,
        "--train_file",
        str(tmp / "train.csv"),
        batch="4",
    )
    assert read_csv_rows(predicted / "test_predictions.csv") == read_csv_rows(out / "soup" / "test_predictions.csv")
    assert run["results"]["soup_test_f1"] == json.loads((predicted / "all_results.json").read_text())["test_f1"]


def test_the_rule_is_fitted_on_out_of_fold_rows_only(run, tmp_path):
    """Refitted from the folder's files with the test labels scrambled: the same rule; its temperature is scipy's
    minimum of the out-of-fold log loss; its bias no worse than any single change on its grid."""
    from scipy.optimize import minimize_scalar

    from nlp_tricks.functional.decision_rules import BIAS_GRID, apply_class_bias, apply_temperature, macro_fbeta

    from kfold_rules import fit_rule

    out = run["out"]
    rule = json.loads((out / "decision_rule.json").read_text())
    copy = tmp_path / "kf"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("fold?", "full_fit", "soup", "student", "rule"))
    records = [json.loads(line) for line in (copy / "data" / "test.jsonl").read_text().splitlines()]
    for record, label in zip(records, reversed([r["label"] for r in records])):
        record["label"] = "work" if label == "animal" else "animal"
    (copy / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("test_predictions.csv", "test_probabilities.npy"):
        (copy / name).unlink()
    data_args = TASKS["classification"].parse(["--train_file", str(run["tmp"] / "train.csv")])[0]
    again = fit_rule([copy], TASKS["classification"], LABELS, ["temperature", "bias"], 1.0, data_args)
    assert {k: again[k] for k in ("temperature", "bias")} == {k: rule[k] for k in ("temperature", "bias")}

    log_p = np.log(np.clip(np.load(out / "oof_probabilities.npy").astype(np.float64), 1e-30, None))
    gold = np.asarray([LABELS.index(label) for _, label in CLS_TRAIN])

    def nll(inverse):
        return -np.mean(np.log(apply_temperature(log_p, 1 / inverse)[np.arange(len(gold)), gold]))

    reference = minimize_scalar(nll, bounds=(1 / 20, 1 / 0.05), method="bounded", options={"xatol": 1e-9})
    assert nll(1 / rule["temperature"]) <= reference.fun + 1e-7
    tempered = np.log(apply_temperature(log_p, rule["temperature"]))
    best = macro_fbeta(gold, apply_class_bias(tempered, rule["bias"]), 2)
    assert best >= macro_fbeta(gold, tempered.argmax(1), 2)
    for j in range(2):
        for value in BIAS_GRID:
            trial = np.array(rule["bias"])
            trial[j] = value
            assert macro_fbeta(gold, apply_class_bias(tempered, trial), 2) <= best + 1e-12


def test_rule_oof_is_cross_fitted_and_the_folder_predicts_with_the_rule(run, monkeypatch):
    """A fold's rows under the rule fitted on the other fold only: their own labels scrambled, the same
    predictions. The folder (its manifest and its rule) predicts what DIR/rule/ holds."""
    from kfold_rules import cross_fitted, read_oof

    out, tmp = run["out"], run["tmp"]
    rule = json.loads((out / "decision_rule.json").read_text())
    data_args = TASKS["classification"].parse(["--train_file", str(tmp / "train.csv")])[0]
    inputs, gold, fold_of = read_oof(out, TASKS["classification"], LABELS, data_args)
    scrambled = gold.copy()
    scrambled[fold_of == 0] = 1 - scrambled[fold_of == 0]
    first, second = (
        cross_fitted(inputs, gold, fold_of, rule, LABELS),
        cross_fitted(inputs, scrambled, fold_of, rule, LABELS),
    )
    assert [int(first[i]) for i in np.flatnonzero(fold_of == 0)] == [
        int(second[i]) for i in np.flatnonzero(fold_of == 0)
    ]
    oof = read_csv_rows(out / "rule" / "oof_predictions.csv")
    assert [r["predicted"] for r in oof] == [LABELS[int(i)] for i in first]
    for key, value in sklearn_scores(oof, LABELS).items():
        assert run["results"][f"rule_oof_{key}"] == pytest.approx(value, abs=1e-12)

    predicted = predict_through(
        "classification", str(out), str(tmp / "test.csv"), tmp / "predicted_rule", monkeypatch, batch="4"
    )
    assert read_csv_rows(predicted / "test_predictions.csv") == read_csv_rows(out / "rule" / "test_predictions.csv")
    tempered = np.load(predicted / "test_probabilities.npy")
    raw = np.load(out / "test_probabilities.npy").astype(np.float64)
    want = raw ** (1 / rule["temperature"])
    np.testing.assert_allclose(tempered, want / want.sum(1, keepdims=True), rtol=1e-5)  # float32 written
    for key in ("test_nll", "rule_test_nll", "oof_nll", "rule_oof_nll", "test_ece", "rule_test_ece"):
        assert np.isfinite(run["results"][key]), key


def test_the_teacher_of_another_architecture_and_tokenizer_labels_every_row(run):
    """The student's soft targets are the Llama teacher's own softmax on each text, read with its own tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from teacher import soft_targets

    teacher = run["teacher"]
    model = AutoModelForSequenceClassification.from_pretrained(teacher).eval()
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    rows = [{"text": text, "label": label} for text, label in CLS_TRAIN]
    args = TASKS["classification"].parse(
        [
            "--train_file",
            str(run["tmp"] / "train.csv"),
            "--output_dir",
            str(run["tmp"] / "scratch"),
            "--per_device_eval_batch_size",
            "4",
        ]
    )
    targets, info = soft_targets(teacher, "classification", rows, list(reversed(LABELS)), *args)
    assert info == {"teacher": str(teacher), "kind": "model", "teacher_rows": {"ensemble": len(rows)}}
    for row, target in zip(rows, targets):
        with torch.no_grad():
            logits = model(**tokenizer(row["text"], return_tensors="pt")).logits[0].double()
        want = torch.softmax(logits, -1).numpy()[::-1]  # the student's label order, reversed here
        np.testing.assert_allclose(target, want, rtol=1e-5, atol=1e-6)  # padded batches vs one text: float32
    student = json.loads((run["out"] / "student" / "all_results.json").read_text())
    assert student["teacher"]["teacher"] == str(teacher) and student["train_samples"] == len(CLS_TRAIN)


def test_a_kfold_teacher_gives_each_row_the_fold_model_that_did_not_see_it(run):
    """A k-fold run as teacher: a training row's target is its out-of-fold prediction (oof_probabilities.npy, the
    fold model whose training file lacks the row); a row it never trained on gets the ensemble's."""
    from teacher import soft_targets

    out, tmp = run["out"], run["tmp"]
    rows = [{"text": text, "label": label} for text, label in [*CLS_TRAIN, *CLS_TEST]]
    args = TASKS["classification"].parse(
        ["--train_file", str(tmp / "train.csv"), "--output_dir", str(tmp / "s2"), "--per_device_eval_batch_size", "4"]
    )
    targets, info = soft_targets(out, "classification", rows, LABELS, *args)
    fold_of = json.loads((out / "folds.json").read_text())["fold_of_example"]
    assert info["kind"] == "kfold" and info["teacher_rows"] == {
        "fold0": fold_of.count(0),
        "fold1": fold_of.count(1),
        "ensemble": len(CLS_TEST),
    }
    oof = np.load(out / "oof_probabilities.npy")
    np.testing.assert_allclose(np.stack(targets[: len(CLS_TRAIN)]), oof, rtol=1e-5, atol=1e-6)
    for i, (text, _) in enumerate(CLS_TRAIN):
        trained_on = json.loads((out / f"fold{fold_of[i]}" / "all_results.json").read_text())["data_files"]["train"]
        texts = {json.loads(line)["text"] for line in Path(trained_on).read_text().splitlines()}
        assert text not in texts  # that teacher never saw the row it labels
    np.testing.assert_allclose(
        np.stack(targets[len(CLS_TRAIN) :]), np.load(out / "test_probabilities.npy"), rtol=1e-5, atol=1e-6
    )


def test_a_member_with_other_labels_is_refused_in_one_line(run, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ensemble"
    shutil.copytree(run["out"] / "fold0", folder / "a", ignore=shutil.ignore_patterns("checkpoint*"))
    shutil.copytree(run["out"] / "fold1", folder / "b", ignore=shutil.ignore_patterns("checkpoint*"))
    config = json.loads((folder / "b" / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "work", "1": "animal"}, {"work": 0, "animal": 1}
    (folder / "b" / "config.json").write_text(json.dumps(config))
    write_manifest(folder, "classification", ["a", "b"], LABELS, None)
    args = [
        "--model_name_or_path",
        str(folder),
        "--do_train",
        "false",
        "--test_file",
        str(run["tmp"] / "test.csv"),
        "--output_dir",
        str(tmp_path / "o"),
    ]
    assert run_in_process("classification", args, monkeypatch) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert (
        len(err) == 1 and "member b: its labels ['work', 'animal'] are not the ensemble's ['animal', 'work']" in err[0]
    )
    assert not (tmp_path / "o" / "all_results.json").exists()


def test_full_fit_seeds_alone_and_refusals(tiny_model, tmp_path, capsys):
    write_csv(tmp_path / "train.csv", CLS_TRAIN)
    write_csv(tmp_path / "test.csv", CLS_TEST)
    data = ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]
    out = tmp_path / "kf"
    argv = [
        "--recipe",
        "classification",
        "--folds",
        "0",
        "--full_fit_seeds",
        "2",
        "--soup",
        "uniform",
        "--output_dir",
        str(out),
        "--",
        *flags(tiny_model, "--max_steps", "2"),
        *data,
    ]
    assert kfold.main(argv, run=run_here) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert not (out / "fold0").exists() and not (out / "kfold_ensemble.json").exists()
    assert (out / "full_fit" / "kfold_ensemble.json").is_file() and results["full_fit_soup_members"] == [
        "seed0",
        "seed1",
    ]
    assert [global_step(out / "full_fit" / f"seed{k}") for k in range(2)] == [2, 2]
    for extra, message in (
        (["--folds", "0"], "--folds 0 trains no fold: give --full_fit_seeds N"),
        (["--folds", "0", "--full_fit_seeds", "1", "--fit_rule", "bias"], "rules are fitted on out-of-fold"),
        (["--folds", "2", "--fit_rule", "threshold"], "per-type span thresholds are for --span_head"),
        (["--folds", "0", "--full_fit_seeds", "1", "--soup", "greedy"], "give --validation_file after --"),
        (["--folds", "2", "--teacher", "x"], "--teacher: it teaches the student; add --distill true"),
    ):
        base = [
            "--recipe",
            "classification",
            "--output_dir",
            str(tmp_path / "r"),
            *extra,
            "--",
            *flags(tiny_model),
            *data,
        ]
        with pytest.raises(SystemExit) as exit_:
            kfold.main(base, run=run_here)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, extra


def test_rules_of_several_runs_average_their_parameters(run, tmp_path):
    """--fit_rule_runs: each run's rule fitted on its own out-of-fold rows, the biases averaged, the temperatures
    averaged geometrically (another run here: the same files with other out-of-fold probabilities)."""
    from kfold_rules import fit_rule

    runs = []
    for k, power in enumerate((1.0, 3.0)):
        copy = tmp_path / f"run{k}"
        shutil.copytree(
            run["out"], copy, ignore=shutil.ignore_patterns("fold?", "full_fit", "soup", "student", "rule")
        )
        probabilities = np.load(copy / "oof_probabilities.npy").astype(np.float64) ** power
        np.save(copy / "oof_probabilities.npy", probabilities / probabilities.sum(1, keepdims=True))
        runs.append(copy)
    data_args = TASKS["classification"].parse(["--train_file", str(run["tmp"] / "train.csv")])[0]
    task, names = TASKS["classification"], ["temperature", "bias"]
    alone = [fit_rule([r], task, LABELS, names, 1.0, data_args) for r in runs]
    both = fit_rule(runs, task, LABELS, names, 1.0, data_args)
    assert alone[0]["temperature"] != pytest.approx(alone[1]["temperature"])
    assert both["temperature"] == pytest.approx(np.sqrt(alone[0]["temperature"] * alone[1]["temperature"]))
    assert both["bias"] == pytest.approx([(a + b) / 2 for a, b in zip(alone[0]["bias"], alone[1]["bias"])])
    assert both["runs"] == [str(r) for r in runs]


def test_an_adapter_member_is_checked_against_its_runs_label_list(tmp_path):
    """A LoRA adapter folder (--merge_lora false) has no config.json: its labels are all_results.json's label_list."""
    from nlp_tricks.data import DataError

    from ensemble_tasks import check_member_labels

    member = tmp_path / "fold0"
    member.mkdir()
    (member / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base"}))
    (member / "all_results.json").write_text(json.dumps({"label_list": ["animal", "work"]}))
    check_member_labels(member, ["animal", "work"])
    with pytest.raises(DataError, match=r"member fold0: its labels \['animal', 'work'\] are not the ensemble's"):
        check_member_labels(member, ["work", "animal"])
