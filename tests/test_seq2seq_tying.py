"""Encoder-decoder weight tying: what is shared, that it stays shared through training, DDP and save / reload."""

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, EncoderDecoderModel, default_data_collator

from nlp_tricks.seq2seq import Seq2SeqTricksTrainer, tie_encoder_decoder
from tiny import bert_seq_cls, seq2seq_data
from tiny_seq2seq import bart_lm, bert2bert, seq2seq_args, t5_lm


def _untied_t5():
    """transformers 5's T5Config always ties the embeddings; untie them by hand."""
    model = t5_lm()
    model.decoder.embed_tokens.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    return model


UNTIED = {
    "bart": lambda: bart_lm(tie_word_embeddings=False),
    "t5": _untied_t5,
    "bert2bert": bert2bert,
}


def _embedding_matrices(model):
    return [
        model.get_input_embeddings().weight,  # BART's and T5's `shared`
        model.get_encoder().get_input_embeddings().weight,
        model.get_decoder().get_input_embeddings().weight,
        model.get_output_embeddings().weight,
    ]


def _unique_count(model):
    """Reference count: numbers in distinct storages, found by data pointer."""
    seen = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[p.data_ptr()] = p.numel()
    return sum(seen.values())


@pytest.mark.parametrize("name", list(UNTIED))
def test_embeddings_scope_shares_one_matrix(name):
    model = UNTIED[name]()
    before = _unique_count(model)
    distinct = len({m.data_ptr() for m in _embedding_matrices(model)})
    assert distinct > 1  # BERT2BERT's decoder ties its own LM head
    tie_encoder_decoder(model, "embeddings")
    matrices = _embedding_matrices(model)
    assert len({m.data_ptr() for m in matrices}) == 1
    assert model.config.nlp_tricks_tie_scope == "embeddings"
    assert _unique_count(model) == before - (distinct - 1) * matrices[0].numel()


# Hand-written: what a BERT layer's self-attention, feed-forward and norms are called.
BERT_LAYER = [
    "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
    "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm",
]  # fmt: skip


def test_all_scope_bert2bert_shares_layers_but_not_cross_attention():
    model = bert2bert()
    tie_encoder_decoder(model, "all")
    enc, dec = model.encoder, model.decoder.bert
    for i in range(2):
        for sub in BERT_LAYER:
            for kind in ("weight", "bias"):
                a = enc.get_parameter(f"encoder.layer.{i}.{sub}.{kind}")
                b = dec.get_parameter(f"encoder.layer.{i}.{sub}.{kind}")
                assert a is b, f"layer {i} {sub}.{kind}"
        cross = dec.encoder.layer[i].crossattention
        assert all(p.data_ptr() not in {q.data_ptr() for q in enc.parameters()} for p in cross.parameters())
    for emb in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm"):
        assert getattr(enc.embeddings, emb).weight is getattr(dec.embeddings, emb).weight, emb
    assert model.decoder.cls.predictions.decoder.weight is enc.embeddings.word_embeddings.weight


def test_all_scope_t5_aligns_feed_forward_not_cross_attention():
    """T5's encoder block is [self-attn, FF], the decoder's [self-attn, cross-attn, FF]: FF pairs with FF."""
    model = t5_lm()
    tie_encoder_decoder(model, "all")
    for i in range(2):
        enc_block, dec_block = model.encoder.block[i].layer, model.decoder.block[i].layer
        assert enc_block[0].SelfAttention.q.weight is dec_block[0].SelfAttention.q.weight
        assert enc_block[0].layer_norm.weight is dec_block[0].layer_norm.weight
        assert enc_block[1].DenseReluDense.wi.weight is dec_block[2].DenseReluDense.wi.weight
        assert enc_block[1].layer_norm.weight is dec_block[2].layer_norm.weight
        # the cross-attention's norm has the FF norm's name and shape but is not the same thing
        assert dec_block[1].layer_norm.weight is not enc_block[1].layer_norm.weight
        assert dec_block[1].EncDecAttention.q.weight is not enc_block[0].SelfAttention.q.weight
    assert model.encoder.final_layer_norm.weight is model.decoder.final_layer_norm.weight


def _batch():
    data = seq2seq_data(n=4)
    return default_data_collator([data[i] for i in range(4)])


@pytest.mark.parametrize("scope", ["embeddings", "all"])
@pytest.mark.parametrize("name", list(UNTIED))
def test_save_and_reload_keeps_ties_and_outputs(tmp_path, name, scope):
    model = UNTIED[name]().eval()
    ties = tie_encoder_decoder(model, scope)
    with torch.no_grad():
        expected = model(**_batch()).logits
    model.save_pretrained(tmp_path)
    cls = EncoderDecoderModel if name == "bert2bert" else AutoModelForSeq2SeqLM
    reloaded = cls.from_pretrained(tmp_path).eval()
    assert reloaded.config.nlp_tricks_tie_scope == scope
    assert tie_encoder_decoder(reloaded) == ties  # the recorded scope, the same ties
    for target, source in ties.items():
        assert reloaded.get_parameter(target) is reloaded.get_parameter(source), target
    with torch.no_grad():
        assert torch.equal(reloaded(**_batch()).logits, expected)


@pytest.mark.parametrize("name", ["bart", "bert2bert"])
def test_ties_hold_through_training(tmp_path, name):
    model = UNTIED[name]()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    untied_count = _unique_count(model)
    args = seq2seq_args(tmp_path, tie_encoder_decoder="all", scheduled_sampling="constant", ss_k=0.5, max_steps=2)
    trainer = Seq2SeqTricksTrainer(model=model, args=args, train_dataset=seq2seq_data(n=8))
    ties = tie_encoder_decoder(model)  # read back the ties the trainer made (re-tying is a no-op)
    pointers = {t: model.get_parameter(s).data_ptr() for t, s in ties.items()}
    trainer.train()
    for target, source in ties.items():
        assert model.get_parameter(target) is model.get_parameter(source)
        assert model.get_parameter(target).data_ptr() == pointers[target]
    for n, p in model.named_parameters():
        if "pooler" not in n:  # BERT's pooler is not used by a seq2seq model
            assert not torch.equal(before[n], p.detach()), f"{n} did not change"
    first = next(e for e in trainer.state.log_history if "loss" in e)
    assert first["unique_parameters"] == _unique_count(model) < untied_count
    assert first["unique_parameters_untied"] == untied_count
    assert sum("unique_parameters" in e for e in trainer.state.log_history) == 1


def test_trainer_reties_a_reloaded_model(tmp_path):
    model = bart_lm(tie_word_embeddings=False)
    tie_encoder_decoder(model, "all")
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert reloaded.model.decoder.layers[0].fc1.weight is not reloaded.model.encoder.layers[0].fc1.weight
    Seq2SeqTricksTrainer(model=reloaded, args=seq2seq_args(tmp_path / "run"))
    assert reloaded.model.decoder.layers[0].fc1.weight is reloaded.model.encoder.layers[0].fc1.weight
    with pytest.raises(ValueError, match="tie_encoder_decoder='all'"):
        Seq2SeqTricksTrainer(model=reloaded, args=seq2seq_args(tmp_path / "run", tie_encoder_decoder="embeddings"))


def test_ties_hold_under_ddp(tmp_path):
    """One-process gloo DDP: the wrapper registers each shared parameter once and the step keeps the tie."""
    import torch.distributed as dist

    model = bart_lm(tie_word_embeddings=False)
    tie_encoder_decoder(model, "all")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(**_batch()).loss.backward()
        optimizer.step()
    finally:
        dist.destroy_process_group()
    assert (
        model.model.decoder.layers[1].self_attn.k_proj.weight is model.model.encoder.layers[1].self_attn.k_proj.weight
    )
    assert model.lm_head.weight is model.model.encoder.embed_tokens.weight


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="scope=None"):
        tie_encoder_decoder(bart_lm())
    with pytest.raises(ValueError, match="scope='layers'"):
        tie_encoder_decoder(bart_lm(), "layers")
    with pytest.raises(ValueError, match="encoder-decoder"):
        tie_encoder_decoder(bert_seq_cls(), "embeddings")
    assert tie_encoder_decoder(bart_lm(), "none") == {}
