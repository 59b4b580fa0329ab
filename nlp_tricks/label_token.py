"""A causal LM as a sequence classifier scored on label tokens: :class:`LabelTokenClassifier`.

The prompt (see :mod:`nlp_tricks.data.prompts`) ends where the answer goes; the class logits are the LM head's
logits of the label words' first tokens at that last position (:func:`nlp_tricks.functional.label_token.
label_token_logits`), computed from the decoder's last hidden state there and the head's C rows, never the
``(batch, length, vocabulary)`` logits. To the rest of the code it is a sequence classifier with C logits
(``SequenceClassifierOutput``): the Trainer's losses, focal loss, class weights, R-Drop, distillation targets,
ensembles and metrics work on it as on a classification head. Untrained, it predicts the LM's own next-token
preference among the label tokens (zero-shot).

Its parameters are the causal LM's, under the LM's own names (the wrapper adopts the LM's modules), so its state dict,
a PEFT adapter trained on it (``peft.get_peft_model(classifier, LoraConfig(...))``) and its checkpoints are the
causal LM's: ``save_pretrained`` writes a normal causal-LM folder plus ``label_token.json`` (the labels, their words
and token ids, the prompt template), and :func:`load_label_token_model` loads such a folder (or a LoRA adapter folder
trained on one) back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from .functional.label_token import label_token_logits, positions_from_mask

__all__ = [
    "LABEL_TOKEN_FILE",
    "LabelTokenClassifier",
    "label_token_ids",
    "is_label_token_folder",
    "read_label_token_file",
    "load_label_token_model",
]

#: Beside the model: the labels (in class order), their words, the words' first token ids and the prompt template.
LABEL_TOKEN_FILE = "label_token.json"


def label_token_ids(tokenizer, words: list[str]) -> list[int]:
    """The token scored for each label word: the first token of the word as the tokenizer reads it after a space
    (``tokenizer.encode(" " + word, add_special_tokens=False)[0]``).

    Raises:
        ValueError: a word without tokens, or words sharing their first token (named, with that token).
    """
    ids = []
    for word in words:
        encoded = tokenizer.encode(" " + word, add_special_tokens=False)
        if not encoded:
            raise ValueError(f"label word {word!r} has no token")
        ids.append(int(encoded[0]))
    by_token: dict[int, list[str]] = {}
    for word, token in zip(words, ids):
        by_token.setdefault(token, []).append(word)
    for token, sharing in by_token.items():
        if len(sharing) > 1:
            shown = tokenizer.convert_ids_to_tokens(token)
            raise ValueError(
                f"label words {', '.join(map(repr, sharing))} share their first token {shown!r}; give words that "
                "start differently (--label_words label=word,...)"
            )
    return ids


class LabelTokenClassifier(PreTrainedModel):
    """A causal LM whose class logits are its next-token logits of C label tokens at the prompt's last token.

    Args:
        lm (`PreTrainedModel`): the causal LM (``AutoModelForCausalLM``); its modules become this model's, under the
            same names, and its config is this model's config (``num_labels`` / ``id2label`` / ``problem_type`` are
            read from it).
        token_ids (`list[int]`): the C label tokens, in class order (:func:`label_token_ids`).
        label_words (`list[str]`, *optional*): the words, for ``label_token.json``.
        prompt_template (`str`, *optional*): the template, for ``label_token.json``.

    ``forward(input_ids, attention_mask, labels=None, ...)`` returns ``SequenceClassifierOutput(loss, logits (B, C))``.
    The answer position of each row is its last kept token (left or right padding); position ids count kept tokens,
    so both paddings give the same logits. With ``labels``: cross-entropy over the C logits, or binary cross-entropy
    per label (``config.problem_type == "multi_label_classification"``, or float labels of the logits' shape).
    """

    config_class = PretrainedConfig
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # The Trainer's item count is not passed to forward: TricksTrainer divides the loss itself.
    accepts_loss_kwargs = False

    def __init__(
        self,
        lm: PreTrainedModel,
        token_ids: list[int],
        label_words: list[str] | None = None,
        prompt_template: str | None = None,
    ):
        super().__init__(lm.config)
        for name, module in lm.named_children():
            self.add_module(name, module)
        # Kept outside the module tree: the LM saves itself (its own file layout, tied weights) from these modules.
        self.__dict__["causal_lm"] = lm
        self.base_model_prefix = lm.base_model_prefix
        self.register_buffer("label_token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        self.label_words = list(label_words) if label_words is not None else None
        self.prompt_template = prompt_template
        if len(token_ids) != self.config.num_labels:
            self.config.num_labels = len(token_ids)

    def get_input_embeddings(self):
        return self.causal_lm.get_input_embeddings()

    def get_output_embeddings(self):
        return self.causal_lm.get_output_embeddings()

    def _head_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.causal_lm.get_output_embeddings()
        if not isinstance(head, nn.Linear) or hasattr(head, "base_layer"):
            raise ValueError(
                f"the label-token head reads the LM head's rows, but {type(self.causal_lm).__name__}'s output layer "
                f"is a {type(head).__name__}; keep LoRA and modules_to_save off the LM head"
            )
        return head.weight, head.bias

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        kwargs.pop("num_items_in_batch", None)
        if attention_mask is None:
            reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
            attention_mask = torch.ones(reference.shape[:2], dtype=torch.long, device=reference.device)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)
        body = getattr(self, self.base_model_prefix)
        outputs = body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            use_cache=False,
            return_dict=True,
            **kwargs,
        )
        weight, bias = self._head_weight_and_bias()
        scale = getattr(self.config, "logit_scale", None)  # Cohere multiplies its logits
        if isinstance(scale, (int, float)) and scale != 1:
            weight, bias = weight * scale, (bias * scale if bias is not None else None)
        logits = label_token_logits(
            outputs.last_hidden_state,
            attention_mask,
            weight,
            self.label_token_ids,
            bias,
            softcap=getattr(self.config, "final_logit_softcapping", None),
        )
        loss = self._loss(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        multi = self.config.problem_type == "multi_label_classification" or (
            labels.is_floating_point() and labels.shape == logits.shape
        )
        if multi:
            return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.to(logits.device).float())
        return nn.functional.cross_entropy(logits.float(), labels.to(logits.device).view(-1))

    def label_token_record(self) -> dict:
        """What ``label_token.json`` holds."""
        labels = [self.config.id2label[i] for i in range(self.config.num_labels)]
        return {
            "labels": labels,
            "label_words": self.label_words if self.label_words is not None else labels,
            "label_token_ids": self.label_token_ids.tolist(),
            "prompt_template": self.prompt_template,
        }

    def save_label_token_file(self, folder: str | Path) -> None:
        """Write ``label_token.json`` into ``folder`` (``save_pretrained`` does; call it beside a PEFT adapter)."""
        path = Path(folder) / LABEL_TOKEN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.label_token_record(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """The causal LM's own ``save_pretrained`` (a normal causal-LM folder) and ``label_token.json``."""
        self.causal_lm.save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            self.save_label_token_file(save_directory)


def is_label_token_folder(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder holding ``label_token.json``."""
    return bool(path) and (Path(path) / LABEL_TOKEN_FILE).is_file()


def read_label_token_file(path: str | Path) -> dict:
    """The ``label_token.json`` of a folder, checked.

    Raises:
        ValueError: unreadable, or its lists disagree in length.
    """
    file = Path(path) / LABEL_TOKEN_FILE
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
        labels, words, ids = record["labels"], record["label_words"], record["label_token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{file}: not a label-token file ({err})") from err
    if not (len(labels) == len(words) == len(ids)):
        raise ValueError(f"{file}: labels, label_words and label_token_ids differ in length")
    return record


def load_label_token_model(
    path: str | Path,
    token_ids: list[int] | None = None,
    config: PretrainedConfig | None = None,
    **kwargs,
) -> LabelTokenClassifier:
    """A :class:`LabelTokenClassifier` from a folder: a causal LM (``AutoModelForCausalLM``), or a LoRA adapter
    folder (``adapter_config.json``: its base model loaded, the adapter applied and merged), with the label tokens
    of its ``label_token.json`` unless ``token_ids`` are given (then the folder may be any causal LM).

    ``config`` and ``kwargs`` go to ``from_pretrained`` (e.g. ``trust_remote_code``).
    """
    path = Path(path)
    record = read_label_token_file(path) if is_label_token_folder(path) else {}
    if token_ids is None:
        if not record:
            raise ValueError(f"{path}: no {LABEL_TOKEN_FILE}; give the label token ids")
        token_ids = record["label_token_ids"]
    adapter = path / "adapter_config.json"
    if adapter.is_file():
        from peft import PeftModel

        base = json.loads(adapter.read_text(encoding="utf-8"))["base_model_name_or_path"]
        lm = AutoModelForCausalLM.from_pretrained(base, config=config, **kwargs)
    else:
        lm = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    model = LabelTokenClassifier(lm, token_ids, record.get("label_words"), record.get("prompt_template"))
    if adapter.is_file():
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
    return model
