"""Model soups (nlp_tricks/soup.py, `nlp-tricks average --soup`): a soup of identical models is the model bitwise, a
uniform soup is the element-wise mean written out here, a greedy soup never scores below its best member on the
selection set, LoRA adapters average tensor by tensor (and that is not the mean of their updates), and members of
different models are refused in one line."""

import itertools
import json
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForSequenceClassification

from nlp_tricks.cli import main as cli_main
from nlp_tricks.soup import SoupError, check_soup_members, greedy_soup, soup_folders, uniform_soup


def bert_classifier(path, seed: int, **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                  num_labels=3, id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2})  # fmt: skip
    config.update(overrides)
    model = BertForSequenceClassification(BertConfig(**config))
    model.save_pretrained(path)
    (path / "vocab.txt").write_text("[PAD]\n[UNK]\nthe\n")
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_soup_of_identical_models_is_bitwise_the_model(tmp_path):
    state = bert_classifier(tmp_path / "m", 0)
    for copies in (2, 3, 7):
        soup = uniform_soup([state] * copies)
        assert all(torch.equal(soup[k], state[k]) for k in state), copies
    assert cli_main(["average", "--soup", "uniform", *[str(tmp_path / "m")] * 3, "--output", str(tmp_path / "o")]) == 0
    saved, written = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "o" / "model.safetensors")
    assert saved.keys() == written.keys() and all(torch.equal(saved[k], written[k]) for k in saved)
    assert (tmp_path / "o" / "vocab.txt").read_text() == "[PAD]\n[UNK]\nthe\n"
    reloaded = BertForSequenceClassification.from_pretrained(tmp_path / "o")
    assert reloaded.config.id2label == {0: "a", 1: "b", 2: "c"}


def test_a_uniform_soup_is_the_element_wise_mean(tmp_path):
    states = [bert_classifier(tmp_path / f"m{s}", s) for s in range(3)]
    folders = [str(tmp_path / f"m{s}") for s in range(3)]
    assert cli_main(["average", "--soup", "uniform", *folders, "--output", str(tmp_path / "o")]) == 0
    written = load_file(tmp_path / "o" / "model.safetensors")
    for key, value in written.items():
        if not value.is_floating_point():
            assert torch.equal(value, states[0][key])
            continue
        # The mean written out, element by element in float64, then rounded to float32 once.
        want = ((states[0][key].double() + states[1][key].double() + states[2][key].double()) / 3).float()
        torch.testing.assert_close(value, want, rtol=0, atol=1e-7, msg=key)  # float64 sums in another order
    info = json.loads((tmp_path / "o" / "soup.json").read_text())
    assert info["soup"] == "uniform" and info["members"] == folders


@pytest.mark.parametrize("seed", range(5))
def test_greedy_never_scores_below_its_best_member_and_follows_wortsman(seed):
    rng = np.random.default_rng(seed)
    table = {}

    def score(indices):  # any function of the chosen set: a random table over subsets
        key = frozenset(indices)
        if key not in table:
            table[key] = float(rng.normal())
        return table[key]

    chosen = greedy_soup(6, score)
    assert chosen.score >= max(chosen.member_scores)
    # Written out: members by their own score, each kept when the soup does not drop.
    order = sorted(range(6), key=lambda i: (-score([i]), i))
    soup, best = [order[0]], score([order[0]])
    for i in order[1:]:
        if score([*soup, i]) >= best:
            soup, best = [*soup, i], score([*soup, i])
    assert chosen.members == soup and chosen.score == best


def test_greedy_soup_of_folders_with_a_selection_score(tmp_path):
    states = [bert_classifier(tmp_path / f"m{s}", s) for s in range(3)]
    key = "classifier.weight"
    target = (states[0][key] + states[2][key]) / 2  # the soup of members 0 and 2 is the best one

    def score(folder):
        return -float((load_file(f"{folder}/model.safetensors")[key] - target).abs().sum())

    info = soup_folders([tmp_path / f"m{s}" for s in range(3)], tmp_path / "o", "greedy", score)
    assert sorted(info["kept"]) == [str(tmp_path / "m0"), str(tmp_path / "m2")]
    assert info["selection_score"] >= max(info["member_scores"])
    assert not (tmp_path / "o.candidate").exists()


def test_cli_greedy_soup_runs_the_selection_command(tmp_path):
    for s in range(2):
        bert_classifier(tmp_path / f"m{s}", s)
    scorer = tmp_path / "scorer.py"  # scores a model folder by its classifier weight's first value
    scorer.write_text(
        "import json, sys, os\nfrom safetensors.torch import load_file\n"
        "os.makedirs(sys.argv[2], exist_ok=True)\n"
        "b = float(load_file(sys.argv[1] + '/model.safetensors')['classifier.weight'][0, 0])\n"
        "json.dump({'test_f1': b}, open(sys.argv[2] + '/all_results.json', 'w'))\n"
    )
    command = f"{sys.executable} {scorer} {{model}} {{output}}"
    argv = ["average", "--soup", "greedy", str(tmp_path / "m0"), str(tmp_path / "m1"), "--output", str(tmp_path / "o"),
            "--select_command", command]  # fmt: skip
    assert cli_main(argv) == 0
    info = json.loads((tmp_path / "o" / "soup.json").read_text())
    weights = [float(load_file(tmp_path / f"m{s}" / "model.safetensors")["classifier.weight"][0, 0]) for s in range(2)]
    assert info["member_scores"] == pytest.approx(weights, abs=1e-7)
    assert info["selection_score"] >= max(weights) - 1e-7


def test_soups_of_different_models_are_refused_in_one_line(tmp_path, capsys):
    bert_classifier(tmp_path / "a", 0)
    bert_classifier(tmp_path / "labels", 0, id2label={0: "a", 1: "c", 2: "b"}, label2id={"a": 0, "c": 1, "b": 2})
    bert_classifier(tmp_path / "tok", 0)
    (tmp_path / "tok" / "vocab.txt").write_text("[PAD]\n[UNK]\nthat\n")
    bert_classifier(tmp_path / "wide", 0, intermediate_size=40)
    capsys.readouterr()  # save_pretrained's progress bars
    for other, message in (("labels", "differ in their config.json 'id2label'"),
                           ("tok", "differ in their tokenizer files"),
                           ("wide", "bert.encoder.layer.0.intermediate.dense.bias: the members' shapes")):  # fmt: skip
        assert cli_main(["average", "--soup", "uniform", str(tmp_path / "a"), str(tmp_path / other), "--output",
                         str(tmp_path / "o")]) == 1  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("nlp-tricks average:") and message in err[0], err
        assert not (tmp_path / "o" / "model.safetensors").exists()


def _adapter(path, seed, rank=2, config=None):
    """A LoRA adapter folder as PEFT saves one (adapter_config.json + adapter_model.safetensors)."""
    torch.manual_seed(seed)
    path.mkdir()
    tensors = {
        "base_model.model.layer.lora_A.weight": torch.randn(rank, 8),
        "base_model.model.layer.lora_B.weight": torch.randn(6, rank),
        "base_model.model.classifier.modules_to_save.weight": torch.randn(3, 6),
    }
    save_file(tensors, path / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "task_type": "SEQ_CLS", "base_model_name_or_path": "base", "r": rank}
    settings.update(
        {"lora_alpha": 4, "target_modules": ["layer"], "modules_to_save": ["classifier"], **(config or {})}
    )
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return tensors


def test_lora_adapters_average_tensor_by_tensor_which_is_not_the_mean_update(tmp_path):
    adapters = [_adapter(tmp_path / f"a{s}", s) for s in range(3)]
    soup_folders([tmp_path / f"a{s}" for s in range(3)], tmp_path / "o")
    written = load_file(tmp_path / "o" / "adapter_model.safetensors")
    for key, value in written.items():
        want = sum(a[key].double() for a in adapters) / 3
        torch.testing.assert_close(value.double(), want, rtol=0, atol=1e-6)
    assert json.loads((tmp_path / "o" / "adapter_config.json").read_text())["r"] == 2
    # mean(B) @ mean(A) is not mean(B @ A): the cross terms B_i A_j stay.
    a_key, b_key = "base_model.model.layer.lora_A.weight", "base_model.model.layer.lora_B.weight"
    mean_update = sum(a[b_key] @ a[a_key] for a in adapters) / 3
    soup_update = written[b_key] @ written[a_key]
    cross = sum(adapters[i][b_key] @ adapters[j][a_key] for i, j in itertools.permutations(range(3), 2)) / 9
    torch.testing.assert_close(soup_update, mean_update / 3 + cross, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(soup_update, mean_update, atol=1e-2)


def test_adapters_of_other_ranks_or_mixed_with_models_are_refused(tmp_path):
    _adapter(tmp_path / "r2", 0)
    _adapter(tmp_path / "r4", 1, rank=4, config={"r": 4})
    with pytest.raises(SoupError, match="differ in their adapter_config.json 'r' \\(2 vs 4\\)"):
        check_soup_members([tmp_path / "r2", tmp_path / "r4"])
    bert_classifier(tmp_path / "model", 0)
    with pytest.raises(SoupError, match="mix whole models and PEFT adapters"):
        check_soup_members([tmp_path / "r2", tmp_path / "model"])
