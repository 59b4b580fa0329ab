"""How the summarization recipe generates and scores: a causal LM's prompt + completion batches and the trainer that
generates from the prompts alone, the generation length, and the lengths of what was generated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from nlp_tricks import TricksTrainer
from nlp_tricks.metrics import load_metric

from common import own_rows

# --generation_max_length, unless given: this percentile of the training summaries' lengths in tokens (EOS included).
GENERATION_LENGTH_PERCENTILE = 99


class PromptCompletionCollator:
    """Batches of prompt + completion examples.

    ``input_ids`` / ``attention_mask`` / ``labels`` are right-padded (labels with -100), for the loss. Examples with a
    ``prompt_length`` (evaluation) also give ``prompt_input_ids`` / ``prompt_attention_mask``, the prompts alone,
    left-padded so that every prompt ends at the last column and generation continues all of them from there.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    @staticmethod
    def _pad(rows: list[list[int]], value: int, left: bool = False) -> torch.Tensor:
        width = max(len(row) for row in rows)
        fill = [[value] * (width - len(row)) for row in rows]
        padded = [pad + row if left else row + pad for pad, row in zip(fill, rows)]
        return torch.tensor(padded, dtype=torch.long)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(f["input_ids"]) for f in features]
        batch = {
            "input_ids": self._pad(ids, self.pad_token_id),
            "attention_mask": self._pad([[1] * len(row) for row in ids], 0),
            "labels": self._pad([list(f["labels"]) for f in features], -100),
        }
        if "prompt_length" in features[0]:
            prompts = [row[: f["prompt_length"]] for row, f in zip(ids, features)]
            batch["prompt_input_ids"] = self._pad(prompts, self.pad_token_id, left=True)
            batch["prompt_attention_mask"] = self._pad([[1] * len(row) for row in prompts], 0, left=True)
        return batch


def generate_completions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **generate_kwargs):
    """What ``model.generate`` adds after left-padded prompts (the prompt columns cut off), under ``no_grad``."""
    with torch.no_grad():
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    return generated[:, input_ids.shape[1] :]


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokens that end a generated summary: the tokenizer's EOS, which ends every training completion (an
    Instruct model's end-of-turn token, ``<|im_end|>`` for SmolLM2), then the model's own generation EOS ids when
    they differ (a base model's ``<|endoftext|>``)."""
    own = model.generation_config.eos_token_id
    own = own if isinstance(own, list) else [own]
    first = [] if tokenizer is None else [tokenizer.eos_token_id]
    return [token for token in dict.fromkeys([*first, *own]) if token is not None]


class PromptCompletionTrainer(TricksTrainer):
    """TricksTrainer (completion-only loss, every trick) whose evaluation generates the summaries.

    ``Seq2SeqTrainer(predict_with_generate=True)`` does not fit a decoder-only model: it generates from the batch's
    ``input_ids`` (prompt and gold summary, right-padded) and returns the prompt with the generated tokens. Here each
    evaluation batch carries the prompts alone, left-padded (:class:`PromptCompletionCollator`): the loss is taken
    on the prompt + summary sequences as in training, the summaries are generated from the prompts (greedy or
    ``--generation_num_beams`` beams, at most ``--generation_max_length`` new tokens, ending at the tokenizer's EOS:
    :func:`stop_token_ids`) and returned without the prompt, with the batch's labels (the recipe's
    ``compute_metrics`` scores against the split's whole reference texts, so the labels only tell Trainer's loop
    that there is something to score). Trainer's own loop does the rest (batches, progress bar, gathering across
    processes in order, ``compute_metrics``). A LoRA model built with ``--merge_lora`` is merged when training ends
    (``common.merge_trained_adapter``, in the recipes' end of run), so evaluation runs without the adapter.
    """

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = dict(inputs)
        prompt_ids = inputs.pop("prompt_input_ids", None)
        prompt_mask = inputs.pop("prompt_attention_mask", None)
        if prediction_loss_only or prompt_ids is None or not getattr(self.args, "predict_with_generate", True):
            loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only=True, ignore_keys=ignore_keys)
            return loss, None, None
        prompt_ids, prompt_mask = prompt_ids.to(self.args.device), prompt_mask.to(self.args.device)
        loss, prompt_cache = self._loss_and_prompt_cache(model, inputs, prompt_ids, prompt_mask)
        model = self.accelerator.unwrap_model(model)
        completions = generate_completions(
            model,
            prompt_ids,
            prompt_mask,
            **prompt_cache,
            max_new_tokens=getattr(self.args, "generation_max_length", None) or 128,
            num_beams=getattr(self.args, "generation_num_beams", None) or 1,
            do_sample=False,
            eos_token_id=stop_token_ids(self.processing_class, model),
            pad_token_id=self.processing_class.pad_token_id,
        )
        return loss, completions, inputs["labels"].to(completions.device)

    def _loss_and_prompt_cache(self, model, inputs: dict, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """The batch's loss from one forward over the left-padded prompts followed by their right-padded
        completions, and that forward's key / value cache cut to the prompts (their last token left out, for
        ``generate`` to start from): generation then skips its own pass over the prompts. The positions are counted
        from each row's first token, as ``generate`` counts them, so the loss is the right-padded batch's (float
        round-off) and the cache the one ``generate`` would build, as ``generate``'s keyword. ``(loss, {})`` where the
        model's cache cannot be cut (generation then reads the prompts itself)."""
        inputs = self._prepare_inputs(inputs)
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        prompt_lengths, lengths = prompt_mask.sum(1, keepdim=True), mask.sum(1, keepdim=True)
        width = int((lengths - prompt_lengths).max())
        index = prompt_lengths + torch.arange(width, device=ids.device)
        present = index < lengths
        index = index.clamp(max=ids.shape[1] - 1)
        pad = self.processing_class.pad_token_id
        completion = ids.gather(1, index).masked_fill(~present, pad)
        completion_labels = labels.gather(1, index).masked_fill(~present, -100)
        joint_mask = torch.cat([prompt_mask, present.long()], dim=1)
        joint = {
            "input_ids": torch.cat([prompt_ids, completion], dim=1),
            "attention_mask": joint_mask,
            "position_ids": (joint_mask.cumsum(1) - 1).clamp(min=0),
            "labels": torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1),
            "use_cache": True,
        }
        self._loss_only = True  # the loss's logits are not returned: a chunked loss may skip them
        try:
            with torch.no_grad(), self.compute_loss_context_manager():
                loss, outputs = self.compute_loss(model, joint, return_outputs=True)
        finally:
            self._loss_only = False
        # Newer transformers name the outputs' and generate's `past_key_values` `cache`.
        name = "cache" if isinstance(outputs, dict) and outputs.get("cache") is not None else "past_key_values"
        cache = outputs.get(name) if isinstance(outputs, dict) else None
        if cache is None or not hasattr(cache, "crop"):
            return loss.detach().mean(), {}
        cache.crop(prompt_ids.shape[1] - 1 - joint["input_ids"].shape[1])  # negative: the tokens to remove
        return loss.detach().mean(), {name: cache}


def generation_length(label_lengths: list[int], max_target_length: int) -> int:
    """``--generation_max_length`` when not given: the ``GENERATION_LENGTH_PERCENTILE``-th percentile of the training
    summaries' lengths in tokens, EOS included (an observed length, rounded up), at most ``--max_target_length``,
    which is the most the model learnt to write before its EOS."""
    if not label_lengths:
        return max_target_length
    return min(int(np.percentile(label_lengths, GENERATION_LENGTH_PERCENTILE, method="higher")), max_target_length)


def summary_lengths(predictions: np.ndarray, stop_ids: list[int], pad_token_id: int | None) -> tuple[np.ndarray, ...]:
    """Per generated row: its length in tokens before the first stop token (EOS), padding or -100, and whether that
    first token is a stop token (the summary ended on its own rather than at ``--generation_max_length``)."""
    ends = np.isin(predictions, [*stop_ids, -100] + ([] if pad_token_id is None else [pad_token_id]))
    lengths = np.where(ends.any(axis=1), ends.argmax(axis=1), predictions.shape[1])
    first = predictions[np.arange(len(predictions)), np.minimum(lengths, predictions.shape[1] - 1)]
    stopped = (lengths < predictions.shape[1]) & np.isin(first, stop_ids)
    return lengths, stopped


def decode_summaries(tokenizer, ids: np.ndarray) -> list[str]:
    """Generated token ids (-100: padding) as texts, special tokens dropped."""
    ids = np.where(ids != -100, ids, tokenizer.pad_token_id)
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def summary_metrics(tokenizer, eval_examples: dict[str, list[dict]], stop_ids: list[int], causal: bool) -> dict:
    """Per split, ``compute_metrics``: ROUGE of the generated summaries against the split's full reference
    summaries, as read (the labels are cut to --max_target_length for training), with ``gen_len``, ``ref_len`` and
    ``gen_stopped``."""
    rouge = load_metric("rouge")

    def split_metrics(examples: list[dict]):
        references = [ex["summary"] for ex in examples]
        reference_lengths = tokenizer(references, add_special_tokens=False, return_length=True)["length"]

        def compute_metrics(eval_pred):
            predictions = own_rows(eval_pred.predictions, len(examples))
            scores = rouge.compute(predictions=decode_summaries(tokenizer, predictions), references=references)
            scores = {key: float(value) for key, value in scores.items()}
            # A seq2seq model's generation starts with its decoder start token (BART's is its EOS).
            lengths, stopped = summary_lengths(
                predictions if causal else predictions[:, 1:], stop_ids, tokenizer.pad_token_id
            )
            scores["gen_len"] = float(np.mean(lengths))
            scores["ref_len"] = float(np.mean(reference_lengths))
            scores["gen_stopped"] = float(np.mean(stopped))
            return scores

        return compute_metrics

    return {split: split_metrics(examples) for split, examples in eval_examples.items()}


def write_summaries(path: Path, examples: list[dict], predictions: np.ndarray, tokenizer) -> None:
    """``test_predictions.jsonl``: ``{"reference", "prediction"}`` per example, in order."""
    lines = [
        json.dumps({"reference": ex["summary"], "prediction": pred}, ensure_ascii=False)
        for ex, pred in zip(examples, decode_summaries(tokenizer, predictions))
    ]
    path.write_text("\n".join(lines) + "\n", "utf-8")
