"""The label-token head (nlp_tricks.label_token, nlp_tricks.functional.label_token) against the causal LM's own full
forward written out: the class logits are its next-token logits of the label tokens at the prompt's last token; no
other position or vocabulary row takes part in the loss; left and right padding agree; it saves as a causal LM and
reloads; its step costs the memory of a classification head's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaForSequenceClassification

from nlp_tricks.functional.label_token import answer_positions, label_token_logits
from nlp_tricks.label_token import LABEL_TOKEN_FILE, LabelTokenClassifier, label_token_ids, load_label_token_model
from tiny import word_tokenizer
from tiny_causal import gpt2_lm, llama_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _memory import PeakTensorBytes, storages_are_preserved  # noqa: E402

TOKENS = [11, 23, 42]  # the label tokens of the tests, in class order


def right_padded(lengths=(7, 4, 9), vocab=99, seed=0):
    """Prompts of different lengths, right-padded with 0; ``(input_ids, attention_mask)``."""
    g = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.zeros(len(lengths), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(5, vocab, (n,), generator=g)
        mask[row, :n] = 1
    return ids, mask


def to_left_padding(ids, mask):
    """The same prompts, left-padded."""
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        left_ids[row, -n:], left_mask[row, -n:] = ids[row, :n], 1
    return left_ids, left_mask


def own_next_token_logits(lm, ids, mask):
    """The causal LM's own full forward, row by row without padding: its logits at the last token, (B, V)."""
    rows = []
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        rows.append(lm(input_ids=ids[row : row + 1, :n]).logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("build", [llama_lm, gpt2_lm], ids=["llama", "gpt2"])
def test_probabilities_are_the_softmax_over_the_label_tokens_of_the_lms_own_logits(build):
    lm = build().eval()
    model = LabelTokenClassifier(lm, TOKENS).eval()
    ids, mask = right_padded()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        reference = own_next_token_logits(lm, ids, mask)[:, TOKENS]
    assert logits.shape == (3, len(TOKENS))
    # One row against the head's full (V, H) product: float32 round-off of two matrix products.
    torch.testing.assert_close(logits.softmax(-1), reference.softmax(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_soft_capped_logits_are_capped_as_the_model_caps_them():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5, pad_token_id=0,
    )  # fmt: skip
    lm = Gemma2ForCausalLM(config).eval()
    ids, mask = right_padded(lengths=(6, 6))
    with torch.no_grad():
        logits = LabelTokenClassifier(lm, TOKENS)(input_ids=ids, attention_mask=mask).logits
        reference = lm(input_ids=ids).logits[:, -1, TOKENS]
    assert reference.abs().max() < 0.5  # capped
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", [llama_lm, gpt2_lm], ids=["llama", "gpt2"])
def test_left_and_right_padding_give_the_same_logits(build):
    model = LabelTokenClassifier(build(), TOKENS).eval()
    ids, mask = right_padded()
    left_ids, left_mask = to_left_padding(ids, mask)
    assert answer_positions(mask).tolist() == [6, 3, 8] and answer_positions(left_mask).tolist() == [8, 8, 8]
    with torch.no_grad():
        right = model(input_ids=ids, attention_mask=mask).logits
        left = model(input_ids=left_ids, attention_mask=left_mask).logits
    # Masked keys weigh exactly 0, but the sums run over other lengths: float32 round-off.
    torch.testing.assert_close(left, right, rtol=1e-5, atol=1e-6)


def test_no_other_position_or_vocabulary_row_takes_part_in_the_loss():
    lm = llama_lm()
    model = LabelTokenClassifier(lm, TOKENS)
    ids, mask = right_padded()
    labels = torch.tensor([0, 2, 1])
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    out.loss.backward()
    grad = lm.lm_head.weight.grad
    others = torch.ones(grad.shape[0], dtype=torch.bool)
    others[TOKENS] = False
    assert torch.count_nonzero(grad[others]) == 0
    assert torch.count_nonzero(grad[TOKENS].abs().sum(-1)) == len(TOKENS)

    # The last hidden state at every other position: changing it changes nothing.
    answer = answer_positions(mask)
    noise = torch.randn(3, ids.shape[1], 32) * 10
    noise[torch.arange(3), answer] = 0

    def perturb(module, args, output):
        return output + noise

    with torch.no_grad():
        clean = model(input_ids=ids, attention_mask=mask).logits
        handle = lm.model.norm.register_forward_hook(perturb)
        try:
            perturbed = model(input_ids=ids, attention_mask=mask).logits
        finally:
            handle.remove()
    assert torch.equal(perturbed, clean)


def test_multi_label_loss_is_binary_cross_entropy_per_label_word():
    lm = llama_lm()
    lm.config.problem_type = "multi_label_classification"
    model = LabelTokenClassifier(lm, TOKENS)
    ids, mask = right_padded()
    labels = torch.tensor([[1.0, 0, 1], [0, 0, 0], [0, 1, 0]])
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, labels))


def test_label_words_sharing_a_first_token_are_refused_naming_them():
    tokenizer = word_tokenizer(words=("yes", "no", "maybe"))
    assert label_token_ids(tokenizer, ["yes", "no"]) == [5, 6]  # after the 5 specials
    with pytest.raises(ValueError, match=r"label words 'perhaps', 'unsure' share their first token '\[UNK\]'"):
        label_token_ids(tokenizer, ["yes", "perhaps", "unsure"])


def test_the_saved_folder_is_a_causal_lm_that_reloads_and_predicts_the_same(tmp_path):
    lm = llama_lm()
    model = LabelTokenClassifier(lm, TOKENS, ["a", "b", "c"], "Q: {text} A:")
    model.config.id2label = {0: "x", 1: "y", 2: "z"}
    with torch.no_grad():  # trained weights: not the init the reload would give
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(plain).__name__ == "LlamaForCausalLM"
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for name, tensor in lm.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name
    assert json.loads((tmp_path / LABEL_TOKEN_FILE).read_text()) == {
        "labels": ["x", "y", "z"],
        "label_words": ["a", "b", "c"],
        "label_token_ids": TOKENS,
        "prompt_template": "Q: {text} A:",
    }
    reloaded = load_label_token_model(tmp_path).eval()
    ids, mask = right_padded()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits, model.eval()(ids, mask).logits)


def test_a_lora_adapter_trained_on_it_reloads_merged(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(LabelTokenClassifier(llama_lm(), TOKENS), LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    model.save_pretrained(tmp_path)
    model.get_base_model().save_label_token_file(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    # The adapter's weights carry the causal LM's own names: it loads onto the plain LM too.
    llama_lm().save_pretrained(tmp_path / "base")
    saved["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter_config.json").write_text(json.dumps(saved))
    reloaded = load_label_token_model(tmp_path).eval()
    assert isinstance(reloaded, LabelTokenClassifier)
    ids, mask = right_padded()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids, attention_mask=mask).logits,
            model.eval()(input_ids=ids, attention_mask=mask).logits,
            rtol=1e-5,
            atol=1e-6,
        )  # merged weights: W + BA added once, float32 round-off


def test_functional_logits_read_only_the_selected_rows():
    hidden = torch.randn(2, 5, 4)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    weight, bias = torch.randn(10, 4), torch.randn(10)
    logits = label_token_logits(hidden, mask, weight, torch.tensor([3, 7]), bias)
    expected = torch.stack([hidden[0, 4] @ weight[[3, 7]].T, hidden[1, 2] @ weight[[3, 7]].T]) + bias[[3, 7]]
    torch.testing.assert_close(logits, expected)
    with pytest.raises(ValueError, match="keeps no token"):
        answer_positions(torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.skipif(not storages_are_preserved(), reason="the meter needs torch's preserved storage objects")
def test_a_label_token_step_costs_the_memory_of_a_classification_heads_step():
    """Same tiny Llama (vocabulary 8192: its (B, L, V) logits would be 8 MiB, ten times the step's activations),
    same batch, LoRA on both: peak bytes of the tensors the forward and backward allocate, within 1.1x; the LM's own
    full logits would cost many times more."""
    from peft import LoraConfig, get_peft_model

    vocab, lora = 8192, dict(r=4, target_modules=["q_proj", "v_proj"])
    ids, mask = right_padded(lengths=(64, 64, 50, 64), vocab=vocab)
    labels = torch.tensor([0, 1, 2, 0])

    def peak(model, logits_of=lambda out: out.logits) -> int:
        with PeakTensorBytes() as meter:
            out = model(input_ids=ids, attention_mask=mask)
            torch.nn.functional.cross_entropy(logits_of(out), labels).backward()
        return meter.peak

    label_token = get_peft_model(LabelTokenClassifier(llama_lm(vocab_size=vocab), TOKENS), LoraConfig(**lora))
    config = llama_lm(vocab_size=vocab).config
    config.num_labels = 3
    head = get_peft_model(LlamaForSequenceClassification(config), LoraConfig(task_type="SEQ_CLS", **lora))
    full = get_peft_model(llama_lm(vocab_size=vocab), LoraConfig(**lora))
    answer = answer_positions(mask)
    on_full_logits = peak(full, lambda out: out.logits[torch.arange(4), answer][:, TOKENS])
    ratio = peak(label_token) / peak(head)
    assert ratio <= 1.1, ratio
    assert on_full_logits > 5 * peak(label_token)


@pytest.mark.slow  # four fresh processes for the memory column
def test_llm_classifier_benchmark_quick_json():
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "llm_classifier.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert rows["SmolLM2-135M + LoRA, label-token head"]["tensor_vs_head"] <= 1.1
    assert rows["SmolLM2-135M + LoRA, label tokens from the full logits"]["tensor_vs_head"] > 2
    assert all(r["step_s"] > 0 and r["predict_s"] > 0 for r in rows.values())
