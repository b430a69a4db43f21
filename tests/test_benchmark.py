"""The bandwidth floor's byte count: what each method's round must read."""

from conftest import tiny_spec
from draftline.core.benchmark import geometry
from draftline.core.engine import Engine

EAGLE3 = {"method": "eagle3", "draft": {"random_init": {"preset": "tiny-eagle3", "seed": 1}}, "num_speculative_tokens": 4}
MTP = {"method": "gemma4_mtp", "draft": {"random_init": {"preset": "tiny-mtp", "seed": 1}}, "num_speculative_tokens": 3}


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if "embed_tokens" not in n)


def test_plain_decoding_reads_the_target_once():
    engine = Engine(tiny_spec({"method": "none"}))
    cfg, geo = engine.target.config, geometry(engine)
    assert geo.weights == _bytes(engine.target) + (cfg.vocab_size * cfg.hidden_size * 4 if cfg.tie_word_embeddings else 0)
    assert geo.kv_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert geo.tokens_in == 1


def test_chain_drafters_read_their_weights_once_per_step():
    """EAGLE-3: K passes over its layer and own head, fc once, its one-layer cache K times.
    MTP: K passes over its layers and the target's head, the target's last-layer KV read by
    each of its layers at each step."""
    for method, k in ((EAGLE3, 4), (MTP, 3)):
        engine = Engine(tiny_spec(method))
        base = geometry(Engine(tiny_spec({"method": "none"})))
        model, cfg = engine.backend.drafter.model, engine.target.config
        geo = geometry(engine)
        if method is EAGLE3:
            fc = model.fc.weight.numel() * 4
            assert geo.weights - base.weights == k * (_bytes(model) - fc) + fc
            layers = 1
        else:
            head = cfg.vocab_size * cfg.hidden_size * 4
            assert geo.weights - base.weights == k * (_bytes(model) + head)
            layers = model.config.layers.num_layers
        assert geo.kv_per_token - base.kv_per_token == k * 2 * layers * cfg.num_kv_heads * cfg.head_dim * 4
        assert geo.tokens_in == (k + 1) + k
