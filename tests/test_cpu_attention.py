"""fnmoe's CPU attention kernel against fp64 SDPA, next to SDPA's own bf16 error, and its choice."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fnmoe import compile as fcompile
from fnmoe.kernels import attention as cpu_attention
from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.models.attention import causal_attention
from fnmoe.config import DataConfig, ModelConfig, RunConfig, validate
from fnmoe.models.transformer import forward
from fnmoe.models.params import init_params
from fnmoe.tree import flatten_dict, unflatten_dict


def sdpa_BLHU(q, k, v, dy, scale):
    """y and dq, dk, dv of causal SDPA (GQA) in q's dtype, all [B, L, heads, dim]."""
    qq, kk, vv = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=qq.shape[1] != kk.shape[1])
    y.backward(dy.transpose(1, 2))
    return [t.transpose(1, 2) for t in (y, qq.grad, kk.grad, vv.grad)]


@pytest.fixture(params=["bf16 dot products", "fp32 GEMMs"])
def score_path(request):
    """Both ways the kernel computes scores and dP (AVX512-BF16 where the CPU has it)."""
    assert cpu_gemm.available()
    on = torch.ops.fnmoe_cpu.use_bf16_dot(request.param == "bf16 dot products")
    if request.param == "bf16 dot products" and not on:
        pytest.skip("this CPU has no AVX512-BF16")
    yield request.param
    torch.ops.fnmoe_cpu.use_bf16_dot(True)


@pytest.mark.parametrize("B,L,H,G,A,U", [(2, 150, 4, 2, 16, 16), (3, 140, 2, 2, 24, 16), (1, 260, 6, 1, 8, 8),
                                         (2, 40, 2, 1, 70, 70), (1, 30, 2, 2, 7, 5)])
def test_kernel_matches_fp64_sdpa_as_closely_as_bf16_sdpa(B, L, H, G, A, U, score_path):
    """L past one 128-row causal block and not a multiple of it; GQA, MHA with U != A (MLA's
    shape), MQA, head dims of 35 pairs and an odd one (fp32 GEMMs either way). Ours must be within 3x of bf16 SDPA's
    own error against fp64 (or 2 bf16 ulps), on every output."""
    gen = torch.Generator().manual_seed(0)
    q, dy = torch.randn(B, L, H, A, generator=gen), torch.randn(B, L, H, U, generator=gen)
    k, v = torch.randn(B, L, G, A, generator=gen), torch.randn(B, L, G, U, generator=gen)
    q, k, v, dy = (t.bfloat16() for t in (q, k, v, dy))
    scale = 0.7 * A ** -0.5
    ref = sdpa_BLHU(*(t.double() for t in (q, k, v, dy)), scale)
    flash = sdpa_BLHU(q, k, v, dy, scale)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    y = cpu_attention.attention(qq, kk, vv, scale)
    y.backward(dy)
    ours = [y, qq.grad, kk.grad, vv.grad]
    for name, o, f, r in zip(("y", "dq", "dk", "dv"), ours, flash, ref):
        assert o.shape == r.shape and o.dtype == torch.bfloat16, name
        err, flash_err = ((t.double() - r).abs().max().item() / r.abs().max().item() for t in (o, f))
        assert err <= max(3 * flash_err, 8e-3), (name, err, flash_err)


def test_kernel_takes_strided_inputs_and_compiles():
    """q, k, v as views of one fused projection (the model's layouts), eager and compiled alike."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 64, 8, 16, generator=gen).bfloat16()

    def fn(qkv):
        q, k, v = qkv.split([4, 2, 2], dim=2)
        return cpu_attention.attention(q, k, v, 0.25).float().square().sum()

    x1, x2 = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    fn(x1).backward()
    torch.compile(fn, fullgraph=True, backend="aot_eager")(x2).backward()
    assert torch.equal(x1.grad, x2.grad)


def test_choice_rules():
    cfg = ModelConfig(n_heads=4, n_kv_heads=2, attention_impl="auto")
    threads = torch.get_num_threads()
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    rows = max(1, -(-threads // 2))  # enough (batch, kv head) tasks for every thread
    assert cpu_attention.choice(cfg, rows, 256, bf16, cpu) == "cpu"
    assert cpu_attention.choice(cfg, rows, 256, torch.float32, cpu) == "sdpa"  # fp32: SDPA, exact against HF
    assert cpu_attention.choice(cfg, rows, 4096, bf16, cpu) == "sdpa"  # long rows: flash's blocks
    assert cpu_attention.choice(cfg, rows, 256, bf16, cpu, mask=torch.ones(1, dtype=torch.bool)) == "sdpa"
    assert cpu_attention.choice(dataclasses.replace(cfg, attention_impl="sdpa"), rows, 256, bf16, cpu) == "sdpa"
    explicit = dataclasses.replace(cfg, attention_impl="cpu")
    assert cpu_attention.choice(explicit, 1, 4096, bf16, cpu) == "cpu"
    with pytest.raises(ValueError, match="attention_impl='cpu' cannot run here: it takes bfloat16 on CPU"):
        cpu_attention.choice(explicit, 1, 256, torch.float32, cpu)
    with pytest.raises(ValueError, match="document mask"):
        cpu_attention.choice(explicit, 1, 256, bf16, cpu, mask=torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="2.0 GiB at L=16384, r=2"):
        cpu_attention.choice(explicit, 1, 16384, bf16, cpu)


def test_choice_without_the_extension(monkeypatch, caplog):
    monkeypatch.setattr(cpu_gemm, "build_error", lambda: "RuntimeError: no C++ compiler")
    monkeypatch.setattr(cpu_gemm, "_loaded", False)
    monkeypatch.setattr(fcompile, "_said", set())  # said here, and again where other tests expect it
    cfg = ModelConfig(attention_impl="auto")
    assert cpu_attention.choice(cfg, 64, 256, torch.bfloat16, torch.device("cpu")) == "sdpa"
    assert "did not build (RuntimeError: no C++ compiler)" in caplog.text
    with pytest.raises(ValueError, match="did not build"):
        cpu_attention.choice(dataclasses.replace(cfg, attention_impl="cpu"), 64, 256, torch.bfloat16, "cpu")


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_model_with_the_kernel_tracks_sdpa(attention):
    """bf16 loss and gradients of a small model, kernel against SDPA: as close as two bf16 runs."""
    extra = dict(q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8) \
        if attention == "mla" else {}
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, attention=attention,
                      compute_dtype="bfloat16", attention_impl="cpu", **extra)
    params = init_params(cfg, seed=0)
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(2))

    def loss_and_grads(c):
        leaves = {k: v.detach().requires_grad_() for k, v in flatten_dict(params).items()}
        logits, _ = forward(unflatten_dict(leaves), tokens, c)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64).float(), tokens[:, 1:].reshape(-1))
        return loss, torch.autograd.grad(loss, list(leaves.values()))

    ours, ref = loss_and_grads(cfg), loss_and_grads(dataclasses.replace(cfg, attention_impl="sdpa"))
    assert abs(ours[0].item() - ref[0].item()) < 1e-2
    for a, b in zip(ours[1], ref[1]):
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6


def test_config_names_what_the_cpu_kernel_cannot_take():
    with pytest.raises(ValueError) as got:
        validate(RunConfig(model=ModelConfig(attention_impl="cpu"), data=DataConfig(doc_mask=True)))
    assert "model.attention_impl='cpu' takes bfloat16 compute (model.compute_dtype='float32')" in str(got.value)
    assert "data.doc_mask=true needs 'auto' or 'sdpa'" in str(got.value)
    validate(RunConfig(model=ModelConfig(attention_impl="cpu", compute_dtype="bfloat16")))


def test_explicit_cpu_kernel_refuses_fp32_in_the_model():
    """The config check at the model's entry points names it before anything runs; the kernel's own
    check (reached when the model runs on rows it cannot take) names why it cannot run."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, attention_impl="cpu")
    params = init_params(dataclasses.replace(cfg, attention_impl="auto"), seed=0)
    with pytest.raises(ValueError, match="model.attention_impl='cpu' takes bfloat16 compute"):
        forward(params, torch.zeros(1, 8, dtype=torch.long), cfg)
    with pytest.raises(ValueError, match="model.attention_impl='cpu' takes bfloat16 compute"):
        init_params(cfg, seed=0)
    with pytest.raises(ValueError, match="attention_impl='cpu' cannot run here"):
        cpu_attention.choice(cfg, 1, 8, torch.float32, torch.device("cpu"))


def test_causal_attention_resolves_auto_when_called_directly(monkeypatch):
    """auto on [4, 32] bf16 rows with 2 kv heads (8 tasks) takes the kernel while the threads are at
    most 8 and SDPA beyond: its output is, bit for bit, the path it chose (the two differ)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 32, h, 16, generator=gen).bfloat16() for h in (4, 2, 2))
    cfg = ModelConfig(n_heads=4, n_kv_heads=2)
    kernel = causal_attention(q, k, v, dataclasses.replace(cfg, attention_impl="cpu"))
    sdpa = causal_attention(q, k, v, dataclasses.replace(cfg, attention_impl="sdpa"))
    assert kernel.shape == sdpa.shape == (4, 32, 4, 16) and not torch.equal(kernel, sdpa)
    assert (kernel.float() - sdpa.float()).abs().max() < 3e-2
    for threads, want in ((8, kernel), (9, sdpa)):  # the rule's thread count, not the machine's
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        assert torch.equal(causal_attention(q, k, v, cfg), want), threads



def test_a_build_is_foreseen_so_the_log_can_say_so(tmp_path):
    """needs_build: the extension's library missing, or older than a file of csrc/, means cpp_extension
    builds it (~17 s): build_error then says so in the log before and after."""
    import os

    assert cpu_gemm.needs_build(tmp_path)
    lib = tmp_path / f"{cpu_gemm.NAME}.so"
    lib.write_bytes(b"")
    assert not cpu_gemm.needs_build(tmp_path)
    os.utime(lib, (0, 0))  # older than every source
    assert cpu_gemm.needs_build(tmp_path)
