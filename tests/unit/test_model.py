"""The gpt3 model: shape, FLOPs formula, parameter count, and exact parity with Hugging Face GPT-2."""

import math

import pytest
import torch

from scaletrain.config import resolve
from scaletrain.model.flops import flops_per_token, mfu, num_params
from scaletrain.model.gpt import GPT
from scaletrain.model.loss import IGNORE_INDEX, loss_sum


def tiny(**kw):
    over = [
        f"model.{k}={v}"
        for k, v in {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 300, **kw}.items()
    ]
    return resolve("gpt3-proxy", overrides=over).model


def test_gpt3_175b_flops_per_token_pinned():
    cfg = resolve("gpt3-175b").model
    assert cfg.padded_vocab == 51200
    assert flops_per_token(cfg) == pytest.approx(1.0764e12, rel=5e-5)
    h, s, n_l, v = 12288, 2048, 96, 51200
    assert flops_per_token(cfg) == pytest.approx(72 * n_l * h * h * (1 + s / (6 * h) + v / (12 * n_l * h)), rel=1e-12)


def test_gpt3_175b_parameter_count():
    # 174.6B with the padded 51200-row embedding and 2048 positions (GPT-3 paper: "175B").
    assert num_params(resolve("gpt3-175b").model) == 174_615_846_912


def test_param_count_matches_module():
    cfg = tiny()
    assert sum(p.numel() for p in GPT(cfg).parameters()) == num_params(cfg)
    assert cfg.padded_vocab == 384


def test_mfu_definition():
    cfg = resolve("gpt3-175b").model
    assert mfu(832, cfg, 989e12) == pytest.approx(832 * 1.0764e12 / 989e12, rel=1e-4)


def test_init_std_and_tied_head():
    torch.manual_seed(0)
    cfg = resolve("gpt3-proxy").model
    model = GPT(cfg)
    w = model.blocks["0"].mlp.fc.weight
    assert abs(w.std().item() - 0.006) < 2e-4
    assert model.blocks["0"].attn.qkv.bias.abs().max() == 0
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, cfg.padded_vocab)
    expected = torch.nn.functional.linear(
        model.ln_f(model.embed.tok(x) + model.embed.pos(torch.arange(16))), model.embed.tok.weight
    )
    assert not torch.allclose(logits, expected)  # blocks do contribute
    assert model.head.weight is model.embed.tok.weight and model.head_is_tied
    assert len(list(model.parameters())) == len(set(map(id, model.parameters())))


def test_init_is_a_function_of_seed_and_name():
    cfg = tiny()
    a, b, c = GPT(cfg, seed=3), GPT(cfg, seed=3), GPT(cfg, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.std() > 0:
            assert not torch.equal(pa, pc), name
    # Distinct parameters draw from distinct streams.
    assert not torch.equal(a.blocks["0"].mlp.fc.weight[:64], a.blocks["1"].mlp.fc.weight[:64])
    # Statistics of the counter-based normal generator.
    w = torch.cat([p.flatten() for n, p in a.named_parameters() if n.endswith("weight") and p.dim() == 2])
    assert abs(w.mean().item()) < 2e-4 and abs(w.std().item() / cfg.init_std - 1) < 0.01
    # Meta build, then materialise and re-init: identical to the eager build.
    with torch.device("meta"):
        m = GPT(cfg, seed=3)
    m.to_empty(device="cpu")
    assert not m.head_is_tied  # to_empty replaces parameters one module at a time
    m.tie_weights()
    assert m.head_is_tied
    m.init_weights(3)
    for (name, pa), pm in zip(a.named_parameters(), m.parameters()):
        assert torch.equal(pa, pm), name


def test_causal():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x = torch.randint(0, 300, (1, 20))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 7) % 300
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-6)
        assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:])


def test_loss_sum_ignores_masked():
    logits = torch.randn(1, 4, 10)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 3]])
    full = torch.nn.functional.cross_entropy(logits[0, [0, 1, 3]], labels[0, [0, 1, 3]], reduction="sum")
    assert torch.allclose(loss_sum(logits, labels), full)
    # An untrained model predicts ~uniformly: loss ~ log(V).
    torch.manual_seed(0)
    cfg = tiny()
    x, y = torch.randint(0, 300, (2, 2, 32))  # labels unlike the inputs: the tied head favours the input token
    loss = loss_sum(GPT(cfg)(x), y) / y.numel()
    assert abs(loss.item() - math.log(cfg.padded_vocab)) < 0.05


def test_sequence_too_long_is_clear():
    with pytest.raises(ValueError, match="exceeds model.seq_len"):
        GPT(tiny())(torch.zeros(1, 33, dtype=torch.long))


def test_logits_equal_huggingface_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tiny()
    ours = GPT(cfg).eval()
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.padded_vocab,
        n_positions=cfg.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    sd = {
        "transformer.wte.weight": ours.embed.tok.weight,
        "transformer.wpe.weight": ours.embed.pos.weight,
        "transformer.ln_f.weight": ours.ln_f.weight,
        "transformer.ln_f.bias": ours.ln_f.bias,
    }
    names = {
        "ln1": "ln_1",
        "ln2": "ln_2",
        "attn.qkv": "attn.c_attn",
        "attn.proj": "attn.c_proj",
        "mlp.fc": "mlp.c_fc",
        "mlp.proj": "mlp.c_proj",
    }
    for i, block in ours.blocks.items():
        for ours_name, hf_name in names.items():
            mod = block.get_submodule(ours_name)
            transpose = not ours_name.startswith("ln")  # HF's Conv1D stores (in, out)
            weight, bias = mod.weight, mod.bias
            if ours_name == "attn.qkv":  # ours (head, q|k|v, head_dim) -> HF (q|k|v, head, head_dim)
                h, d = cfg.n_heads, cfg.d_model
                weight = weight.view(h, 3, d // h, d).transpose(0, 1).reshape(3 * d, d)
                bias = bias.view(h, 3, d // h).transpose(0, 1).reshape(3 * d)
            sd[f"transformer.h.{i}.{hf_name}.weight"] = weight.T if transpose else weight
            sd[f"transformer.h.{i}.{hf_name}.bias"] = bias
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("lm_head" in k or "attn.bias" in k or "masked_bias" in k for k in missing)
    hf.tie_weights()
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        assert torch.allclose(ours(x), hf(input_ids=x).logits, atol=1e-5)
