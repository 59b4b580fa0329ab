"""The summarization recipe's data: its flags, the documents and summaries read and checked, tokenized as document /
summary for a seq2seq model or as prompt + completion for a causal LM, and the counts of what the length limits cut.

recipes/summarization.py runs the recipe; recipes/summarization_models.py loads the model;
recipes/summarization_generation.py generates and scores the summaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.compute as pc
from datasets import Dataset, Features, Value

from nlp_tricks.data import arrow_dataset, demo_summarization, file_signature, iter_table_file
from nlp_tricks.data.arrow import as_dataset, first_rows

from common import (
    TABLE_TRAIN_FILE_HELP,
    DataArguments,
    dataset_help,
    eval_splits,
    load_splits,
    map_options,
    warn,
)

# Causal LMs: the instruction of the prompt, and the prompt's end without a chat template.
DEFAULT_INSTRUCTION = "Summarize the following text."


PLAIN_PROMPT_END = "\n\nSummary:"


@dataclass
class SummarizationDataArguments(DataArguments):
    """Where the documents and summaries come from and how they are cut."""

    FLAG_HELP = {
        "dataset_name": dataset_help("ACLSum shipped by the demo extra", "(e.g. cnn_dailymail)"),
        "train_file": TABLE_TRAIN_FILE_HELP,
    }

    text_column: str = field(default="text", metadata={"help": "Column / field of the document."})
    summary_column: str = field(default="summary", metadata={"help": "Column / field of the summary."})
    source_prefix: str = field(default="", metadata={"help": "Text put before every document (T5: 'summarize: ')."})
    max_source_length: int = field(default=256, metadata={"help": "Document tokens kept (the rest is truncated)."})
    max_target_length: int = field(
        default=128,
        metadata={
            "help": "Summary tokens kept for training (ROUGE always scores against the full reference summaries)."
        },
    )
    instruction: str = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "Causal LMs: the instruction before the document in the prompt."},
    )


def load_summarization_splits(data: SummarizationDataArguments) -> dict[str, tuple[Dataset, str]]:
    """``{split: (examples, source name for errors)}`` with train, validation and (if any) test; keys text, summary."""
    columns = [data.text_column, data.summary_column]

    def read_file(path):
        def generate():
            for ex in iter_table_file(path, columns, nonempty=[data.summary_column]):
                yield {"text": ex[data.text_column], "summary": ex[data.summary_column]}

        features = Features({"text": Value("string"), "summary": Value("string")})
        return arrow_dataset(generate, features, [file_signature(path), ["summarization", columns]])

    def hub_converter(features):
        return lambda row: {"text": row[data.text_column], "summary": row[data.summary_column]}

    return load_splits(data, read_file, demo_summarization, "demo (aclsum)", hub_converter)


# ---- Causal LMs: prompt + completion ------------------------------------------------------------------------------


def cut_document(tokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut after its first ``max_tokens`` tokens (tokenized on its own), at the character where that token
    ends (or, for a tokenizer without offsets, the decoded tokens)."""
    try:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # no offsets (a tokenizer without a fast backend)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])
    offsets = encoding["offset_mapping"]
    return text if len(offsets) <= max_tokens else text[: offsets[max_tokens - 1][1]]


def prompt_text(tokenizer, instruction: str, document: str) -> str:
    """The prompt: with a chat template, one user turn ``instruction\n\ndocument`` and the assistant's turn opened
    (``add_generation_prompt``), as ``apply_chat_template`` renders it; without one,
    ``instruction\n\ndocument\n\nSummary:``."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": f"{instruction}\n\n{document}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{instruction}\n\n{document}{PLAIN_PROMPT_END}"


def tokenize_prompt_completion(
    examples, tokenizer, data: SummarizationDataArguments, for_generation: bool = False
) -> Dataset:
    """``input_ids`` = prompt + summary + EOS and ``labels`` -100 on the prompt (the loss is on the completion).

    The prompt (:func:`prompt_text`, the document cut to ``data.max_source_length`` tokens by :func:`cut_document`)
    is tokenized as one text, so its tokens are those of ``apply_chat_template(..., tokenize=True)`` (a rendered chat
    template holds its special tokens; a plain prompt gets the tokenizer's own, e.g. a BOS). The summary keeps
    ``data.max_target_length`` tokens with the EOS. With ``for_generation`` (evaluation data) each example also has
    ``prompt_length``, from which the collator builds the left-padded generation prompts. (ROUGE compares with the
    whole summary as the data file has it, neither cut nor passed through the tokenizer: the recipe's metrics.)

    ``examples``: a ``datasets.Dataset`` or a list of dicts; tokenized batch by batch with ``Dataset.map``.
    """
    return _without_counts(_tokenize_prompt_completion(examples, tokenizer, data, for_generation))


def _tokenize_prompt_completion(examples, tokenizer, data, for_generation: bool) -> Dataset:
    """:func:`tokenize_prompt_completion` with the truncation flags of :func:`long_text_flags` in extra columns."""
    options = {"prefix": data.source_prefix, "instruction": data.instruction}
    options.update(max_source_length=data.max_source_length, max_target_length=data.max_target_length)
    return _map(
        examples, encode_prompt_completion_batch, tokenizer, {**options, "for_generation": for_generation}, data
    )


def encode_prompt_completion_batch(
    batch: dict,
    tokenizer,
    prefix: str,
    instruction: str,
    max_source_length: int,
    max_target_length: int,
    for_generation: bool,
) -> dict:
    """One ``map`` batch of :func:`tokenize_prompt_completion`, with ``document_cut`` / ``summary_cut``."""
    chat = bool(tokenizer.chat_template)
    documents = [prefix + text for text in batch["text"]]
    prompts = [
        prompt_text(tokenizer, instruction, cut_document(tokenizer, document, max_source_length))
        for document in documents
    ]
    prompt_ids = tokenizer(prompts, add_special_tokens=not chat)["input_ids"]
    # A plain prompt ends in "Summary:"; the summary follows after a space. A chat turn starts on its own line.
    separator = "" if chat else " "
    summaries = tokenizer([separator + summary for summary in batch["summary"]], add_special_tokens=False)["input_ids"]
    columns = {"input_ids": [], "attention_mask": [], "labels": []}
    if for_generation:
        columns["prompt_length"] = []
    for prompt, summary in zip(prompt_ids, summaries):
        if prompt and prompt[-1] == tokenizer.eos_token_id:  # a tokenizer that appends EOS: not inside a prompt
            prompt = prompt[:-1]
        completion = summary[: max_target_length - 1] + [tokenizer.eos_token_id]
        columns["input_ids"].append(prompt + completion)
        columns["attention_mask"].append([1] * (len(prompt) + len(completion)))
        columns["labels"].append([-100] * len(prompt) + completion)
        if for_generation:
            columns["prompt_length"].append(len(prompt))
    cut = tokenizer(documents, truncation=True, max_length=max_source_length)["input_ids"]
    targets = tokenizer(text_target=batch["summary"], truncation=True, max_length=max_target_length)["input_ids"]
    columns["document_cut"] = long_text_flags(tokenizer, documents, cut, max_source_length)
    columns["summary_cut"] = long_text_flags(tokenizer, batch["summary"], targets, max_target_length, target=True)
    return columns


def long_text_flags(tokenizer, texts: list[str], truncated_ids: list[list[int]], max_length: int, target=False):
    """Per text, whether it is longer than ``max_length`` tokens (``tokenizer(text)``, or ``text_target``), given its
    ids truncated to ``max_length``: only a text whose truncated ids fill ``max_length`` is tokenized again, whole."""
    flags = [False] * len(texts)
    full = [i for i, ids in enumerate(truncated_ids) if len(ids) >= max_length]
    if full:
        chosen = [texts[i] for i in full]
        inputs = {"text_target": chosen} if target else {"text": chosen}
        lengths = tokenizer(**inputs, truncation=False, verbose=False, return_length=True)["length"]
        for i, length in zip(full, lengths):
            flags[i] = length > max_length
    return flags


def _map(examples, function, tokenizer, options: dict, data) -> Dataset:
    """``function`` over ``examples`` (a dataset or a list) in batches, the examples' own columns dropped."""
    dataset = as_dataset(examples)
    if len(dataset) == 0:
        return Dataset.from_dict({"input_ids": [], "labels": [], "document_cut": [], "summary_cut": []})
    return dataset.map(
        function,
        fn_kwargs={"tokenizer": tokenizer, **options},
        remove_columns=dataset.column_names,
        **map_options(data, "Running tokenizer on dataset"),
    )


def _without_counts(dataset: Dataset) -> Dataset:
    return dataset.remove_columns(["document_cut", "summary_cut"])


def truncation_counts(dataset: Dataset) -> tuple[int, int]:
    """``(documents, summaries)`` longer than their maximum lengths, of a split tokenized with the flags."""
    if len(dataset) == 0:
        return 0, 0
    return tuple(pc.sum(dataset.data.column(name)).as_py() or 0 for name in ("document_cut", "summary_cut"))


# ---- Seq2seq models: document / summary ---------------------------------------------------------------------------


def tokenize(examples, tokenizer, data: SummarizationDataArguments, decoder_start: int | None = None) -> Dataset:
    """Token ids of the documents and labels of the summaries. ``decoder_start``: the token the decoder starts from
    ([CLS] for BERT2BERT); a label sequence that begins with it ([CLS] summary [SEP]) loses it, or the decoder would
    learn to answer [CLS] with [CLS] and greedy generation would repeat it. ``examples``: a ``datasets.Dataset`` or a
    list of dicts; tokenized batch by batch with ``Dataset.map``."""
    return _without_counts(_tokenize(examples, tokenizer, data, decoder_start))


def _tokenize(examples, tokenizer, data, decoder_start: int | None) -> Dataset:
    options = {"prefix": data.source_prefix, "decoder_start": decoder_start}
    options.update(max_source_length=data.max_source_length, max_target_length=data.max_target_length)
    return _map(examples, encode_seq2seq_batch, tokenizer, options, data)


def encode_seq2seq_batch(
    batch: dict, tokenizer, prefix: str, max_source_length: int, max_target_length: int, decoder_start: int | None
) -> dict:
    """One ``map`` batch of :func:`tokenize`, with ``document_cut`` / ``summary_cut`` (:func:`long_text_flags`)."""
    documents = [prefix + text for text in batch["text"]]
    encodings = tokenizer(documents, truncation=True, max_length=max_source_length)
    targets = tokenizer(text_target=batch["summary"], truncation=True, max_length=max_target_length)["input_ids"]
    document_cut = long_text_flags(tokenizer, documents, encodings["input_ids"], max_source_length)
    summary_cut = long_text_flags(tokenizer, batch["summary"], targets, max_target_length, target=True)
    if decoder_start is not None:
        targets = [ids[1:] if ids[:1] == [decoder_start] else ids for ids in targets]
    return {**encodings, "labels": targets, "document_cut": document_cut, "summary_cut": summary_cut}


# ---- The splits ---------------------------------------------------------------------------------------------------


def summarization_truncation_record(counts: dict[str, tuple[int, int, int]], data) -> dict:
    """For ``all_results.json``: per split, the documents longer than ``--max_source_length``
    (``<prefix>_truncated_examples``) and the summaries longer than ``--max_target_length``
    (``<prefix>_truncated_summaries``: cut for training only; ROUGE uses the full references), from ``{split:
    (long documents, long summaries, examples)}``. A warning for validation / test documents the model sees only in
    part."""
    record = {}
    for split, (documents, summaries, total) in counts.items():
        prefix = "eval" if split == "validation" else split
        record[f"{prefix}_truncated_examples"] = documents
        record[f"{prefix}_truncated_summaries"] = summaries
        if documents and split != "train":
            warn(
                f"{split}: {documents} of {total} documents are longer than --max_source_length "
                f"{data.max_source_length} tokens; the model sees their beginning only"
            )
    return record


def read_data(data_args: SummarizationDataArguments):
    """``(splits, train_examples, eval_examples)``: every file read and checked (one ``file:line`` error on bad
    input), the splits cut to ``--max_train_samples`` / ``--max_eval_samples``."""
    splits = load_summarization_splits(data_args)
    return (
        splits,
        first_rows(splits["train"][0], data_args.max_train_samples),
        eval_splits(splits, data_args.max_eval_samples),
    )


def tokenize_data(data_args, tokenizer, train_examples, eval_examples, causal: bool, decoder_start: int | None):
    """``(train_dataset, eval_datasets, truncation record)``: every split tokenized (``Dataset.map``, cached), as
    prompt + completion for a causal LM, as document / summary for a seq2seq model."""
    datasets, counts = {}, {}
    for split, examples in {"train": train_examples, **eval_examples}.items():
        if causal:
            tokenized = _tokenize_prompt_completion(examples, tokenizer, data_args, for_generation=split != "train")
        else:
            tokenized = _tokenize(examples, tokenizer, data_args, decoder_start)
        datasets[split] = _without_counts(tokenized)
        counts[split] = (*truncation_counts(tokenized), len(examples))
    train_dataset = datasets.pop("train")
    return train_dataset, datasets, summarization_truncation_record(counts, data_args)


def prepare_data(data_args: SummarizationDataArguments, tokenizer):
    """All of the recipe's data work without a model, as for a seq2seq model (benchmarks/data_scale.py times it)."""
    _, train_examples, eval_examples = read_data(data_args)
    return tokenize_data(data_args, tokenizer, train_examples, eval_examples, False, tokenizer.cls_token_id)
