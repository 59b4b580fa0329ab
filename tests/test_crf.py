"""CRF: log-partition, likelihood, Viterbi and gradients against brute-force enumeration; BIO constraints; gaps;
save / load round trips; the Trainer's CRF loss, exact accumulation, parameter group and Viterbi predictions."""

import copy
import itertools

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, AutoModelForTokenClassification, default_data_collator

from nlp_tricks import TricksTrainer, load_state_dict_portable
from nlp_tricks.functional.crf import CRF, _LogPartition, add_crf, bio_constraints, compact, load_crf_model
from nlp_tricks.runtime import upstream as _upstream
from tiny import bert_token_cls, needs_crf_loading, token_cls_data, tricks_args

BIO = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def _random_crf(num_tags, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    crf = CRF(num_tags).to(dtype)
    with torch.no_grad():
        for p in crf.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * scale)
    return crf


def _brute_force(crf, emissions, allowed=None):
    """Every tag sequence of emissions (n, C), scored in float64: {path: score}. With ``allowed`` (start,
    transitions, end boolean masks) only the sequences they allow are enumerated."""
    start, trans, end = (p.double() for p in (crf.start_transitions, crf.transitions, crf.end_transitions))
    em = emissions.double()
    n, c = em.shape
    paths = torch.tensor(list(itertools.product(range(c), repeat=n))).view(-1, n)
    if allowed is not None:
        a_start, a_trans, a_end = allowed
        keep = a_start[paths[:, 0]] & a_end[paths[:, -1]] & a_trans[paths[:, :-1], paths[:, 1:]].all(dim=1)
        paths = paths[keep]
    scores = start[paths[:, 0]] + em[torch.arange(n), paths].sum(dim=1) + end[paths[:, -1]]
    scores = scores + trans[paths[:, :-1], paths[:, 1:]].sum(dim=1)
    return dict(zip(map(tuple, paths.tolist()), scores.unbind(0)))


def _log_z(scores):
    return torch.logsumexp(torch.stack(list(scores.values())), dim=0)


def _best(scores):
    return list(max(scores, key=lambda path: float(scores[path].detach())))


@pytest.mark.parametrize("num_tags", [3, 4])
def test_log_likelihood_and_viterbi_equal_brute_force_on_a_padded_batch(num_tags):
    lengths = [5, 1, 3, 4, 2]
    crf = _random_crf(num_tags, seed=num_tags)
    g = torch.Generator().manual_seed(1)
    emissions = torch.randn(len(lengths), 5, num_tags, generator=g) * 2
    tags = torch.randint(0, num_tags, (len(lengths), 5), generator=g)
    mask = torch.arange(5) < torch.tensor(lengths)[:, None]
    tags[~mask] = -100  # padding may hold anything
    ll = crf.log_likelihood(emissions, tags, mask)
    paths = crf.decode(emissions, mask)
    assert ll.shape == (len(lengths),)
    for b, n in enumerate(lengths):
        scores = _brute_force(crf, emissions[b, :n])
        expected = scores[tuple(tags[b, :n].tolist())] - _log_z(scores)
        # float32 forward algorithm against float64 enumeration.
        torch.testing.assert_close(ll[b].double(), expected, rtol=1e-5, atol=1e-5)
        assert paths[b] == _best(scores)


def test_every_length_from_one_to_five_without_a_mask():
    crf = _random_crf(3, seed=7)
    for n in range(1, 6):
        emissions = torch.randn(2, n, 3)
        tags = torch.randint(0, 3, (2, n))
        ll = crf.log_likelihood(emissions, tags)
        paths = crf.decode(emissions)
        for b in range(2):
            scores = _brute_force(crf, emissions[b])
            torch.testing.assert_close(
                ll[b].double(), scores[tuple(tags[b].tolist())] - _log_z(scores), rtol=1e-5, atol=1e-5
            )
            assert paths[b] == _best(scores)


def test_gaps_in_the_mask_take_the_counted_positions_in_order():
    """Labels with -100 sub-tokens: the sequence is the labelled positions, as if the gaps were not there."""
    crf = _random_crf(4, seed=3)
    emissions = torch.randn(3, 7, 4)
    labels = torch.tensor(
        [
            [-100, 1, -100, 2, 3, -100, -100],  # [CLS] w ## w w [SEP] pad
            [-100, 0, 1, -100, -100, -100, -100],
            [-100, -100, -100, -100, -100, -100, -100],  # nothing labelled (truncated away)
        ]
    )
    mask = labels != -100
    ll = crf.log_likelihood(emissions, labels, mask)
    paths = crf.decode(emissions, mask)
    for b in range(2):
        positions = mask[b].nonzero().squeeze(1)
        scores = _brute_force(crf, emissions[b, positions])
        expected = scores[tuple(labels[b, positions].tolist())] - _log_z(scores)
        torch.testing.assert_close(ll[b].double(), expected, rtol=1e-5, atol=1e-5)
        assert paths[b] == _best(scores)
    assert ll[2] == 0 and paths[2] == []


def test_gradients_equal_those_of_the_enumeration():
    """Autograd through the brute-force log-likelihood (float64) is the reference for every input's gradient."""
    crf = _random_crf(3, seed=5)
    emissions = torch.randn(2, 4, 3, requires_grad=True)
    tags = torch.tensor([[0, 2, 1, 1], [2, 2, 0, -100]])
    mask = tags != -100
    crf.log_likelihood(emissions, tags, mask).sum().backward()
    ours = [emissions.grad] + [p.grad for p in (crf.start_transitions, crf.transitions, crf.end_transitions)]

    ref = copy.deepcopy(crf).double()
    ref.zero_grad()
    em = emissions.detach().double().requires_grad_()
    total = 0
    for b, n in enumerate([4, 3]):
        scores = _brute_force(ref, em[b, :n])
        total = total + scores[tuple(tags[b, :n].tolist())] - _log_z(scores)
    total.backward()
    expected = [em.grad] + [p.grad for p in (ref.start_transitions, ref.transitions, ref.end_transitions)]
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_log_partition_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(0)
    emissions = torch.randn(3, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([5, 2, 4])
    params = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in [(3,), (3, 3), (3,)]]
    assert torch.autograd.gradcheck(lambda e, s, t, x: _LogPartition.apply(e, lengths, s, t, x), (emissions, *params))


def test_large_scores_stay_exact_where_the_exp_space_product_would_underflow():
    """Emissions of +-100 with a forbidden O -> I-X: the pair marginals fall back to log space; values and
    gradients still equal the enumeration."""
    labels = ["O", "B-X", "I-X"]
    crf = CRF(3).set_constraints(*bio_constraints(labels))
    emissions = torch.tensor([[[100.0, 0.0, 0.0], [0.0, 0.0, 100.0], [0.0, 100.0, 0.0]]], requires_grad=True)
    tags = torch.tensor([[1, 2, 1]])
    ll = crf.log_likelihood(emissions, tags)
    ll.sum().backward()
    allowed = bio_constraints(labels)
    em = emissions.detach().double().requires_grad_()
    scores = _brute_force(crf, em[0], allowed)
    expected = scores[(1, 2, 1)] - _log_z(scores)
    expected.backward()
    torch.testing.assert_close(ll[0].double(), expected.detach(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(emissions.grad.double(), em.grad, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(crf.transitions.grad).all()


def test_bio_constraints_from_label_names():
    allowed_start, allowed, allowed_end = bio_constraints(BIO)
    assert allowed_start.tolist() == [True, True, False, True, False]
    assert allowed_end.all()
    i_per, i_loc = BIO.index("I-PER"), BIO.index("I-LOC")
    for i, prev in enumerate(BIO):
        assert bool(allowed[i, i_per]) == (prev in ("B-PER", "I-PER"))
        assert bool(allowed[i, i_loc]) == (prev in ("B-LOC", "I-LOC"))
    assert allowed[:, [0, 1, 3]].all()
    with pytest.raises(ValueError, match="'E-PER'"):
        bio_constraints(["O", "B-PER", "E-PER"])


def test_constrained_crf_equals_enumeration_of_allowed_sequences_and_never_decodes_a_forbidden_one():
    allowed = bio_constraints(BIO)
    crf = _random_crf(5, seed=11, scale=2.0).set_constraints(*allowed)
    g = torch.Generator().manual_seed(2)
    # I- tags get the highest emissions, so an unconstrained decoder would start with and jump into them.
    emissions = torch.randn(64, 4, 5, generator=g) * 3 + torch.tensor([0.0, 0, 4, 0, 4])
    lengths = torch.randint(1, 5, (64,), generator=g)
    mask = torch.arange(4) < lengths[:, None]
    paths = crf.decode(emissions, mask)
    a_start, a_trans, _ = allowed
    for path in paths:
        assert a_start[path[0]], path
        assert all(a_trans[i, j] for i, j in zip(path, path[1:])), path
    gold = torch.tensor([[1, 2, 2, 0]] * 64)  # B-PER I-PER I-PER O: allowed at every length
    ll = crf.log_likelihood(emissions, gold, mask)
    for b in range(8):
        n = int(lengths[b])
        scores = _brute_force(crf, emissions[b, :n], allowed)
        assert paths[b] == _best(scores)
        torch.testing.assert_close(
            ll[b].double(), scores[tuple(gold[b, :n].tolist())] - _log_z(scores), rtol=1e-5, atol=1e-4
        )


def test_compact_moves_labelled_positions_first():
    emissions = torch.arange(2 * 5 * 1, dtype=torch.float32).view(2, 5, 1)
    labels = torch.tensor([[-100, 3, -100, 4, -100], [2, -100, -100, -100, -100]])
    em, tags, lengths, _ = compact(emissions, labels)
    assert lengths.tolist() == [2, 1]
    assert em.squeeze(-1).tolist() == [[1.0, 3.0], [5.0, 6.0]]  # row 1's second slot is padding
    assert tags.tolist() == [[3, 4], [2, 0]]


def test_bad_inputs_are_refused():
    crf = CRF(3)
    with pytest.raises(ValueError, match="num_tags=3"):
        crf.log_likelihood(torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mask of shape"):
        crf.decode(torch.randn(2, 4, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_tags"):
        CRF(0)


# ---- transformers models: save / load ------------------------------------------------------------------------------


def _ner_model(num_labels=5):
    model = bert_token_cls(num_labels=num_labels)
    model.config.id2label = dict(enumerate(BIO))
    model.config.label2id = {label: i for i, label in enumerate(BIO)}
    return model


def _ner_data(n=8, seed=0, length=12):
    """token_cls_data with valid BIO tags over BIO at its labelled positions (its -100 gaps kept)."""
    data = token_cls_data(n=n, seed=seed, length=length)
    g = torch.Generator().manual_seed(seed)
    allowed_start, allowed, _ = bio_constraints(BIO)
    for item in data.items:
        prev = None
        for t in (item["labels"] != -100).nonzero().squeeze(1).tolist():
            options = (allowed_start if prev is None else allowed[prev]).nonzero().squeeze(1)
            prev = int(options[torch.randint(len(options), (1,), generator=g)])
            item["labels"][t] = prev
    return data


def _word_batch(n=6):
    data = _ner_data(n=n, length=7)  # at most 6 words: 5^6 paths to enumerate
    return default_data_collator([data[i] for i in range(n)])


@needs_crf_loading
def test_save_pretrained_then_one_call_loads_model_and_crf(tmp_path):
    model = _ner_model()
    crf = add_crf(model, bio_constraints=True)
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_()
    model.save_pretrained(tmp_path)
    loaded = load_crf_model(tmp_path)
    assert isinstance(loaded, MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(model.config)])
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    batch = _word_batch()
    mask = batch.pop("labels") != -100
    with torch.no_grad():
        before = model.crf.decode(model(**batch).logits, mask)
        after = loaded.crf.decode(loaded(**batch).logits, mask)
    assert before == after
    assert not loaded.crf.allowed_transitions.all()  # the constraints came back with the weights

    # The same folder through load_state_dict_portable: a fresh model with a CRF attached, loaded strictly.
    fresh = AutoModelForTokenClassification.from_config(model.config)
    add_crf(fresh)
    load_state_dict_portable(fresh, tmp_path)
    with torch.no_grad():
        assert fresh.crf.decode(fresh(**batch).logits, mask) == before


@needs_crf_loading
def test_loading_a_folder_without_a_crf_is_refused(tmp_path):
    _ner_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no CRF weights"):
        load_crf_model(tmp_path)


# ---- TricksTrainer -------------------------------------------------------------------------------------------------


def test_trainer_loss_is_the_sentence_mean_of_the_negative_log_likelihood(tmp_path):
    model = _ner_model()
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, crf=True))
    reference = _random_crf(5, seed=4)
    model.crf.load_state_dict(reference.state_dict())
    batch = _word_batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = trainer.compute_loss(model, batch)
    expected = []
    for b in range(len(logits)):
        positions = (batch["labels"][b] != -100).nonzero().squeeze(1)
        scores = _brute_force(reference, logits[b, positions])
        expected.append(_log_z(scores) - scores[tuple(batch["labels"][b, positions].tolist())])
    torch.testing.assert_close(loss.double(), torch.stack(expected).mean(), rtol=1e-5, atol=1e-5)
    # With the Trainer's count: the sum over sentences / the sentences of the whole accumulated batch.
    counted = trainer._get_num_items_in_batch([batch, batch], torch.device("cpu"))
    assert int(counted) == 2 * len(logits)
    torch.testing.assert_close(trainer.compute_loss(model, batch, num_items_in_batch=counted), loss / 2)


def _crf_step(tmp_path, model, data, batch_size, accumulation):
    args = tricks_args(
        tmp_path,
        crf=True,
        crf_bio_constraints=True,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        crf_lr_scale=4.0,
        weight_decay=0.0,
    )
    TricksTrainer(model=model, args=args, train_dataset=data).train()
    return dict(model.named_parameters())


def test_crf_gradient_accumulation_is_exact(tmp_path):
    """One SGD step on 8 sentences equals 4 x 2 and 2 x 4 micro-batches (word counts differ per sentence)."""
    data = _ner_data()
    base = _ner_model()
    full = _crf_step(tmp_path / "a", copy.deepcopy(base), data, 8, 1)
    assert not torch.equal(full["crf.transitions"], torch.zeros(5, 5))
    for bs, ga in [(4, 2), (2, 4)]:
        accumulated = _crf_step(tmp_path / f"b{bs}", copy.deepcopy(base), data, bs, ga)
        for name, p in full.items():
            # Summation order differs between the splits: float32 round-off only.
            torch.testing.assert_close(accumulated[name], p, rtol=1e-5, atol=1e-6, msg=f"{name} ({bs}x{ga})")


def test_crf_scores_get_their_own_learning_rate_and_train(tmp_path):
    model = _ner_model()
    args = tricks_args(tmp_path, crf=True, crf_lr_scale=50.0, head_lr_scale=3.0, weight_decay=0.1, max_steps=2)
    trainer = TricksTrainer(model=model, args=args, train_dataset=_ner_data())
    trainer.create_optimizer()
    groups = {g["label"]: g for g in trainer.optimizer.param_groups}
    crf_params = {id(p) for p in model.crf.parameters()}
    assert {id(p) for p in groups["crf"]["params"]} == crf_params
    assert groups["crf"]["lr"] == pytest.approx(1e-3 * 50.0) and groups["crf"]["weight_decay"] == 0.0
    assert groups["head"]["lr"] == pytest.approx(1e-3 * 3.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    for name, p in model.named_parameters():
        assert not torch.equal(before[name], p.detach()), f"{name} did not change"


def test_prediction_returns_viterbi_paths_at_the_labelled_positions(tmp_path):
    model = _ner_model()
    with torch.no_grad():
        add_crf(model, bio_constraints=True).load_state_dict(
            _random_crf(5, seed=9, scale=3.0).set_constraints(*bio_constraints(BIO)).state_dict()
        )
    data = _ner_data(n=6)
    trainer = TricksTrainer(model=model, args=tricks_args(tmp_path, crf=True, per_device_eval_batch_size=3))
    out = trainer.predict(data)
    batch = default_data_collator([data[i] for i in range(6)])
    mask = batch["labels"] != -100
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = model.crf.decode(logits, mask)
    predicted = out.predictions.argmax(-1)
    for b in range(6):
        assert predicted[b][mask[b].numpy()].tolist() == expected[b]
        # The logits are one-hot scores of the path.
        assert sorted(set(out.predictions[b].reshape(-1).tolist())) == [0.0, 1.0]
    assert "test_loss" in out.metrics and out.metrics["test_loss"] > 0


def test_crf_settings_are_validated(tmp_path):
    with pytest.raises(ValueError, match="crf_bio_constraints=True needs crf=True"):
        tricks_args(tmp_path, crf_bio_constraints=True)
    with pytest.raises(ValueError, match="loss_type='ce'"):
        tricks_args(tmp_path, crf=True, loss_type="focal")
    with pytest.raises(ValueError, match="crf_lr_scale"):
        tricks_args(tmp_path, crf=True, crf_lr_scale=0.0)
    model = bert_token_cls()  # labels LABEL_0..: not BIO
    with pytest.raises(ValueError, match="BIO tags"):
        TricksTrainer(model=model, args=tricks_args(tmp_path, crf=True, crf_bio_constraints=True))


@pytest.mark.skipif(
    Version(transformers.__version__) >= Version(_upstream.CRF_LOADING_SINCE), reason="load_crf_model works here"
)
def test_load_crf_model_names_the_transformers_it_needs(tmp_path):
    with pytest.raises(RuntimeError, match=f"needs transformers >= {_upstream.CRF_LOADING_SINCE}"):
        load_crf_model(tmp_path)
