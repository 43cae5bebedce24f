"""Triton kernels against their PyTorch references, and the references against plain loops, on fresh inputs."""

import importlib

import pytest
import torch

from dflash2.model import kernels
from dflash2.model.kernels import _backend, grouped_conv_reference, selector_walk_reference

needs_triton = pytest.mark.skipif(_backend.triton is None, reason="triton is not installed")
# The Triton tests run the compiled kernels on a GPU; without one, conftest.py has set TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)


# ---------------------------------------------------------------- grouped conv


def conv_loop(hidden, delta, base, block_size, group_size):
    """The contract's formula one output position at a time."""
    out = []
    for n in range(hidden.shape[0]):
        acc = torch.zeros(hidden.shape[1], dtype=torch.float64)
        for t in range(base.shape[0]):
            if n % block_size - t >= 0:
                coefficient = base[t].double() + delta[n, t].double().repeat_interleave(group_size)
                acc = acc + coefficient * hidden[n - t].double()
        out.append(acc)
    return torch.stack(out)


def conv_inputs(seed, blocks, block_size, hidden_size, group_size, taps, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = blocks * block_size
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    delta = torch.randn(n, taps, hidden_size // group_size, generator=g).to(dtype)
    base = torch.randn(taps, hidden_size, generator=g)
    return hidden, delta, base


@pytest.mark.parametrize("block_size,taps,group_size", [(5, 2, 16), (8, 3, 8), (16, 2, 32), (8, 1, 4)])
def test_conv_reference_matches_loop(block_size, taps, group_size):
    hidden, delta, base = conv_inputs(block_size * 10 + taps, 3, block_size, 32, group_size, taps)
    expected = conv_loop(hidden, delta, base, block_size, group_size)
    got = grouped_conv_reference(hidden, delta, base, block_size)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("blocks", [1, 3, 7])
@pytest.mark.parametrize("block_size", [5, 8, 16])
@pytest.mark.parametrize("hidden_size,group_size", [(48, 16), (48, 12), (256, 256)])
def test_conv_triton_matches_reference(blocks, block_size, hidden_size, group_size):
    taps = 1 + blocks % 3
    seed = 100 * blocks + block_size + group_size
    hidden, delta, base = conv_inputs(seed, blocks, block_size, hidden_size, group_size, taps)
    if blocks * block_size > 64:
        hidden, delta = hidden[:64], delta[:64]  # keeps the interpreter fast; a ragged last block is fine too
    with kernels.backend("triton"):
        got = kernels.grouped_conv(*on_device(hidden, delta, base), block_size)
    torch.testing.assert_close(got.cpu(), grouped_conv_reference(hidden, delta, base, block_size))


@needs_triton
def test_conv_triton_bf16_keeps_dtype():
    hidden, delta, base = conv_inputs(7, 4, 8, 64, 16, 2, dtype=torch.bfloat16)
    with kernels.backend("triton"):
        got = kernels.grouped_conv(*on_device(hidden, delta, base), 8).cpu()
    assert got.dtype == torch.bfloat16
    expected = conv_loop(hidden, delta, base, 8, 16)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)


def test_conv_gradcheck():
    hidden, delta, base = conv_inputs(3, 2, 5, 8, 4, 3, dtype=torch.float64)
    inputs = [x.double().requires_grad_() for x in (hidden, delta, base)]
    with kernels.backend("torch"):
        assert torch.autograd.gradcheck(lambda h, d, b: kernels.grouped_conv(h, d, b, 5), inputs)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_conv_grads_match_loop(name):
    if name == "triton" and _backend.triton is None:
        pytest.skip("triton is not installed")
    hidden, delta, base = conv_inputs(11, 3, 8, 32, 8, 2)
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(12))
    grads = []
    for fn, device in ((lambda *x: conv_loop(*x, 8, 8), "cpu"), (lambda *x: kernels.grouped_conv(*x, 8), DEVICE)):
        leaves = [x.clone().to(device).requires_grad_() for x in (hidden, delta, base)]
        with kernels.backend(name):
            (fn(*leaves) * weight.to(device)).sum().backward()
        grads.append([x.grad.double().cpu() for x in leaves])
    for got, expected in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_conv_rejects_bad_shapes():
    hidden, delta, base = conv_inputs(0, 2, 8, 30, 10, 2)  # 3 groups of 10 channels
    kernels.grouped_conv(hidden, delta[..., :2].contiguous(), base, 8)  # 2 groups of 15 fit too
    with pytest.raises(ValueError, match="a divisor of 30"):
        kernels.grouped_conv(hidden, torch.cat([delta, delta[..., :1]], -1), base, 8)  # 4 groups do not divide 30
    with pytest.raises(ValueError, match="delta"):
        kernels.grouped_conv(hidden, delta[:, :1], base, 8)


# ---------------------------------------------------------------- selector walk


def walk_loop(candidate_ids, scores, uniforms, temperatures, greedy_mask):
    """Contract section 5 one request and one slot at a time, on python lists."""
    batch, n_slots, k = candidate_ids.shape
    tokens, qs = torch.zeros(batch, n_slots, dtype=torch.long), torch.zeros(batch, n_slots, k)
    for b in range(batch):
        previous = 0
        for s in range(n_slots):
            row = scores[b, s, previous]
            if greedy_mask[b]:
                values = row.tolist()
                choice = values.index(max(values))  # list.index is the first occurrence
                qs[b, s, choice] = 1.0
            else:
                probs = torch.softmax(row.float() / temperatures[b], dim=0)
                total, choice = 0.0, 0
                for p in probs.tolist():
                    total += p
                    choice += float(uniforms[b, s]) >= total
                choice = min(choice, k - 1)
                qs[b, s] = probs
            tokens[b, s] = candidate_ids[b, s, choice]
            previous = choice
    return tokens, qs


def walk_inputs(seed, batch, block_size, k, greedy_every=2, ties=False):
    g = torch.Generator().manual_seed(seed)
    n_slots = block_size - 1
    candidate_ids = torch.randint(0, 50_000, (batch, n_slots, k), generator=g)
    if ties:  # few distinct values: ties in almost every row
        scores = torch.randint(0, 3, (batch, n_slots, k, k), generator=g).float()
    else:
        scores = 3 * torch.randn(batch, n_slots, k, k, generator=g)
    scores[:, 0] = scores[:, 0, :1]  # slot 0 follows the anchor: all its rows are the same
    uniforms = torch.rand(batch, n_slots, generator=g)
    temperatures = 0.3 + 1.5 * torch.rand(batch, generator=g)
    greedy_mask = torch.arange(batch) % greedy_every == 0
    temperatures[greedy_mask] = 0.0  # what a greedy request carries; must not leak into anything
    return candidate_ids, scores, uniforms, temperatures, greedy_mask


@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("block_size", [5, 8, 16])
@pytest.mark.parametrize("k", [4, 16])
def test_walk_reference_matches_loop(batch, block_size, k):
    inputs = walk_inputs(batch * 1000 + block_size * 10 + k, batch, block_size, k)
    tokens, q = selector_walk_reference(*inputs)
    expected_tokens, expected_q = walk_loop(*inputs)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(q, expected_q)


@needs_triton
@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("block_size", [5, 8, 16])
@pytest.mark.parametrize("k", [4, 16])
def test_walk_triton_matches_reference(batch, block_size, k):
    inputs = walk_inputs(batch * 1000 + block_size * 10 + k + 1, batch, block_size, k)
    with kernels.backend("triton"):
        tokens, q = kernels.selector_walk(*on_device(*inputs))
    expected_tokens, expected_q = selector_walk_reference(*inputs)
    tokens, q = tokens.cpu(), q.cpu()
    assert tokens.dtype == torch.int64 and q.dtype == torch.float32
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(q, expected_q)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_walk_greedy_rows_ignore_sampled_rows(name):
    if name == "triton" and _backend.triton is None:
        pytest.skip("triton is not installed")
    inputs = walk_inputs(5, 6, 8, 16, greedy_every=2)
    greedy = inputs[4]
    with kernels.backend(name):
        mixed_tokens, mixed_q = (x.cpu() for x in kernels.selector_walk(*on_device(*inputs)))
        alone_tokens, alone_q = (x.cpu() for x in kernels.selector_walk(*on_device(*(x[greedy] for x in inputs))))
    assert torch.equal(mixed_tokens[greedy], alone_tokens)
    assert torch.equal(mixed_q[greedy], alone_q)
    # and the greedy answer is the plain argmax path, whatever the sampled rows drew
    assert torch.equal(alone_tokens, walk_loop(*(x[greedy] for x in inputs))[0])


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_walk_q_is_a_distribution_and_ties_pick_lowest(name):
    if name == "triton" and _backend.triton is None:
        pytest.skip("triton is not installed")
    inputs = walk_inputs(9, 7, 8, 16, greedy_every=3, ties=True)
    greedy = inputs[4]
    with kernels.backend(name):
        tokens, q = (x.cpu() for x in kernels.selector_walk(*on_device(*inputs)))
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:2]))
    assert ((q[greedy] == 0) | (q[greedy] == 1)).all() and (q[greedy].sum(-1) == 1).all()
    expected_tokens, expected_q = walk_loop(*inputs)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(q, expected_q)
    # a row of equal scores must choose index 0 at every slot
    flat = tuple(x.clone() for x in inputs)
    flat[1].zero_()
    with kernels.backend(name):
        tokens = kernels.selector_walk(*on_device(*flat))[0].cpu()
    assert torch.equal(tokens[greedy], flat[0][greedy][..., 0])


def test_walk_rejects_k_not_power_of_two():
    candidate_ids, scores, uniforms, temperatures, greedy_mask = walk_inputs(0, 2, 5, 4)
    with pytest.raises(ValueError, match="power of two"):
        kernels.selector_walk(candidate_ids[..., :3], scores[..., :3, :3], uniforms, temperatures, greedy_mask)


# ---------------------------------------------------------------- backend switch


def test_backend_switch(monkeypatch):
    previous = kernels.get_backend()
    with kernels.backend("torch"):
        assert kernels.get_backend() == "torch"
    assert kernels.get_backend() == previous
    with pytest.raises(ValueError, match="choose one of"):
        kernels.set_backend("cuda")
    monkeypatch.setenv("DFLASH2_KERNELS", "Triton")
    assert _backend.backend_from_env() == "triton"
    monkeypatch.setenv("DFLASH2_KERNELS", "fast")
    with pytest.raises(ValueError, match="DFLASH2_KERNELS"):
        _backend.backend_from_env()


def test_auto_uses_reference_on_cpu(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors under 'auto'")

    # the package re-exports functions under the modules' names, so fetch the modules themselves
    conv_module = importlib.import_module("dflash2.model.kernels.grouped_conv")
    walk_module = importlib.import_module("dflash2.model.kernels.selector_walk")

    monkeypatch.setattr(conv_module, "_grouped_conv_triton", fail)
    monkeypatch.setattr(walk_module, "_selector_walk_triton", fail)
    hidden, delta, base = conv_inputs(1, 2, 5, 32, 8, 2)
    with kernels.backend("auto"):
        kernels.grouped_conv(hidden, delta, base, 5)
        kernels.selector_walk(*walk_inputs(1, 2, 5, 4))


@needs_triton
def test_forced_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_backend, "is_interpreted", lambda kernel: False)
    with kernels.backend("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kernels.selector_walk(*walk_inputs(1, 2, 5, 4))
