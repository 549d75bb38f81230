"""The head loss with the Triton kernels (dflash_core/kernels/head_loss.py) gives the torch passes'
results: on CPU through Triton's interpreter at small shapes, on a GPU at the production shape
against the compiled terms (skipped without CUDA; run through the device tool)."""
import time

import pytest
import torch

from dflash_core.loss.head_loss import LOSS_TYPES, FusedHeadLoss, compiled_head_loss_terms, triton_kernels
from tests.launching import run_in_triton_interpreter

# Run through run_in_triton_interpreter. Every case compares the kernels with the torch passes on the same
# logits; failures come back by name.
_INTERPRETED = """
import json, torch, triton
import triton.language as tl
from dflash_core.kernels import head_loss as head_loss_kernels
from dflash_core.kernels.fp8 import quantise_rows
from dflash_core.loss.head_loss import head_loss_terms, triton_kernels

def logits_and_labels(vocab, dtype, gen):
    logits = (3 * torch.randn(24, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (24,), generator=gen)
    # Exact ties for the argmax, the first index wins: across BLOCK=256 chunks (row 0), inside one
    # chunk (row 1), neighbours (row 2); each label makes the tie-break decide the hit.
    for row, (first, second, label) in enumerate([(130, 900, 900), (300, 400, 300), (5, 6, 6)]):
        logits[row, [first, second]] = 20.0
        labels[row] = label
    labels[3], labels[4] = 0, vocab - 1
    return logits, labels.view(2, 3, 4)

def onehot(labels, vocab):
    return torch.nn.functional.one_hot(labels.reshape(-1), vocab).float()

@triton.jit
def cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n).to(y_ptr.dtype.element_ty), mask=offsets < n)

def codes(e4m3):
    return e4m3.view(torch.uint8).int()

def interpreter_cast(x):
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    cast_kernel[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), y, x.numel(), BLOCK=1024)
    return y

failures = []
for block in (head_loss_kernels.BLOCK, 256):   # one ragged chunk per row; several, the last ragged
    head_loss_kernels.BLOCK = block
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (1000, 1037):
            for loss in ("dflash", "dpace"):
                case = f"BLOCK={block} {dtype} V={vocab} {loss}"
                gen = torch.Generator().manual_seed(vocab)
                logits, labels = logits_and_labels(vocab, dtype, gen)
                weights = (torch.rand(2, 3, 4, generator=gen) > 0.3).float()
                weights[..., 0] = 0
                want = head_loss_terms(logits, labels, weights, loss, 4.0, 0.5)
                want_log_z = torch.logsumexp(logits.float(), dim=-1)
                consumed = logits.clone()
                got = head_loss_terms(consumed, labels, weights, loss, 4.0, 0.5, kernels=triton_kernels())
                try:
                    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
                    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5, msg=lambda m: "ce: " + m)
                    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5, msg=lambda m: "final: " + m)
                    assert torch.equal(got[2], want[2]), f"correct: {got[2].flatten()} != {want[2].flatten()}"
                    # assert_close's defaults for the dtype. bf16's allow a few units in the last place: the
                    # interpreter truncates fp32 to bf16 where torch and the compiled kernel round to nearest.
                    torch.testing.assert_close(got[3], want[3], msg=lambda m: "grad: " + m)
                    assert torch.all(got[3][want[1].flatten() == 0] == 0), "a zero-weight row has a gradient"
                    assert got[3].data_ptr() == consumed.data_ptr(), "the gradient is not in the logits' storage"
                except AssertionError as error:
                    failures.append(f"{case}: {error}")

                # The e4m3 gradient: the statistics' peak is the row's largest |softmax - onehot| (to 1e-5: its
                # log_z sums in another order than torch's), the scales are quantise_rows's of the exact
                # gradient, the values its quantisation (to one code). The reference is cast by the
                # interpreter too: its fp32 -> e4m3 conversion is not round-to-nearest (0.1216 becomes 0.0625),
                # so only the GPU test compares the cast itself with torch's.
                off_label = torch.exp(logits.float() - want_log_z[:, None]) - onehot(labels, vocab)
                exact = off_label * want[1].reshape(-1, 1)
                norm = head_loss_kernels.row_statistics(logits, labels.reshape(-1))[0]
                q, scale = head_loss_terms(logits, labels, weights, loss, 4.0, 0.5,
                                           kernels=triton_kernels(e4m3_gradient=True))[3]
                want_q, want_scale = quantise_rows(exact)
                try:
                    torch.testing.assert_close(norm.peak, off_label.abs().amax(1), rtol=1e-5, atol=1e-7,
                                               msg=lambda m: "peak: " + m)
                    assert q.shape == (32, vocab) and q.dtype == torch.float8_e4m3fn, (q.shape, q.dtype)
                    assert torch.equal(scale[:24], want_scale), "scales differ from quantise_rows's"
                    assert torch.all(q[24:].float() == 0) and torch.all(scale[24:] == 1), "padding rows"
                    # A last-bit difference of exp or log_z moves the rare value across a rounding boundary.
                    apart = (codes(q[:24]) - codes(interpreter_cast(exact / want_scale))).abs()
                    assert (apart > 0).float().mean() < 1e-3 and apart.max() <= 1, "e4m3 values"
                except AssertionError as error:
                    failures.append(f"{case} e4m3: {error}")
print(json.dumps(failures))
"""


def test_kernels_match_the_eager_terms_in_the_interpreter():
    """fp32 and bf16 logits, V = 1000 and 1037, both loss types, the default BLOCK (one ragged
    chunk per row) and BLOCK=256 (the online max and sum across chunks): CE and final weights
    within 1e-5, the same argmax hits (ties included), the gradient within the dtype's rounding,
    zero where the weight is, and written over the logits; the e4m3 gradient with quantise_rows's
    scales and padded to whole 16-row tiles."""
    pytest.importorskip("triton")
    failures = run_in_triton_interpreter(_INTERPRETED)
    assert not failures, "\n".join(failures)


# The production chunk: 32 blocks of 16 slots for 4 rows (2048 logit rows), Qwen3's vocabulary.
BATCH, CHUNK_BLOCKS, BLOCK_SIZE, VOCAB = 4, 32, 16, 151936


def _chunk():
    """The production chunk on the GPU: bf16 logits [2048, VOCAB] (bf16's coarse steps make exact
    ties for the argmax common), labels and 0/1 weights [BATCH, CHUNK_BLOCKS, BLOCK_SIZE] (slot 0 and
    ~30% of the rest zero)."""
    shape = (BATCH, CHUNK_BLOCKS, BLOCK_SIZE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(BATCH * CHUNK_BLOCKS * BLOCK_SIZE, VOCAB, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, VOCAB, shape, device="cuda", generator=gen)
    weights = (torch.rand(shape, device="cuda", generator=gen) > 0.3).float()
    weights[..., 0] = 0
    # Two sure ties across the kernels' chunks, labelled with the later index: the tie-break decides the hit.
    logits[:2, [100, 100_000]] = 30.0
    labels[0, 0, :2] = 100_000
    return logits, labels, weights


def _milliseconds(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("loss", LOSS_TYPES)
def test_kernels_match_the_compiled_terms_at_the_production_shape(loss):
    """2048 x 151936 bf16 logits: CE within 1e-4 (fp32 sums over V in another order), final weights
    within 1e-4 relative, the same argmax hits, the gradient within bf16's rounding and zero where
    the weight is. Prints both versions' time per chunk."""
    from dflash_core.loss.head_loss import head_loss_terms

    def head_loss_terms_triton(*args):
        return head_loss_terms(*args, kernels=triton_kernels())
    logits, labels, weights = _chunk()
    want = compiled_head_loss_terms(logits, labels, weights, loss, 7.0, 0.5)
    got = head_loss_terms_triton(logits.clone(), labels, weights, loss, 7.0, 0.5)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3])
    assert torch.all(got[3][want[1].flatten() == 0] == 0)
    # The kernels overwrite their input, so they are timed on one buffer holding the last call's
    # gradient: the same work, whatever the values.
    buffer = logits.clone()
    kernels = _milliseconds(lambda: head_loss_terms_triton(buffer, labels, weights, loss, 7.0, 0.5))
    compiled = _milliseconds(lambda: compiled_head_loss_terms(logits, labels, weights, loss, 7.0, 0.5))
    print(f"\nhead-loss terms, {tuple(logits.shape)} bf16, {loss}: Triton kernels {kernels:.3f} ms, "
          f"torch.compile {compiled:.3f} ms per chunk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_e4m3_gradient_is_quantise_rows_of_the_gradient_at_the_production_shape():
    """2048 x 151936 bf16 logits: the kernel's e4m3 gradient has quantise_rows's scales of the fp32
    gradient and its values on all but a few rows and elements, those one power of two or one e4m3
    step apart (the kernel's exp and torch's differ in the last fp32 bit, which moves a value across
    a boundary). Prints its time per chunk against the bf16 gradient followed by a compiled
    quantise_rows."""
    from dflash_core.kernels import head_loss as head_loss_kernels
    from dflash_core.kernels.fp8 import ALIGNMENT, quantise_rows
    from dflash_core.loss.head_loss import compiled_quantise_rows, head_loss_terms, loss_weights
    logits, labels, weights = _chunk()
    flat = labels.reshape(-1)
    norm, ce, _ = head_loss_kernels.row_statistics(logits, flat)
    final = loss_weights(ce.view_as(weights), weights, loss="dpace", gamma=7.0, dpace_alpha=0.5).reshape(-1)
    softmax_off_label = torch.exp(logits.float() - norm.log_z[:, None])
    softmax_off_label[torch.arange(len(flat), device="cuda"), flat] -= 1
    torch.testing.assert_close(norm.peak, softmax_off_label.abs().amax(1), rtol=1e-6, atol=0)
    want_q, want_scale = quantise_rows(softmax_off_label * final[:, None])
    q, scale = head_loss_kernels.e4m3_gradient(logits, flat, norm, final, ALIGNMENT)
    assert q.shape == logits.shape and q.dtype == torch.float8_e4m3fn   # 2048 rows: no padding
    # A row whose amax lies within the last bit of a power-of-two boundary may take the neighbouring scale.
    ratio = (scale / want_scale).flatten()
    assert torch.all((ratio == 1) | (ratio == 2) | (ratio == 0.5)) and (ratio != 1).float().mean() < 0.01
    same = ratio == 1
    apart = (q[same].view(torch.uint8).int() - want_q[same].view(torch.uint8).int()).abs()
    assert (apart > 0).float().mean() < 1e-4 and apart.max() <= 1   # same sign, neighbouring codes
    # Every value, whatever its row's scale, within one e4m3 step (2^-3 relative; 2^-9 of the scale below
    # the normals) of the exact gradient.
    exact = softmax_off_label * final[:, None]
    assert torch.all((q.float() * scale - exact).abs() <= exact.abs() * 2**-3 + scale * 2**-9)

    def separate():
        grad = head_loss_terms(logits.clone(), labels, weights, "dpace", 7.0, 0.5, kernels=triton_kernels())[3]
        return compiled_quantise_rows(grad)
    fused = _milliseconds(lambda: head_loss_terms(logits, labels, weights, "dpace", 7.0, 0.5,
                                                  kernels=triton_kernels(e4m3_gradient=True)))
    print(f"\nhead-loss terms to an e4m3 gradient, {tuple(logits.shape)}: fused {fused:.3f} ms, bf16 gradient "
          f"then compiled quantise_rows {_milliseconds(separate):.3f} ms per chunk (the latter with a copy)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_head_loss_runs_the_kernels_on_cuda_when_compiled(monkeypatch):
    """FusedHeadLoss with compiled=True on CUDA calls the kernels once per chunk (3 chunks, the last
    ragged), and its loss, weight sum and hits equal the eager terms'; d(loss)/dh is within 1e-2 relative
    (Frobenius) of theirs: bf16 GEMM outputs of nearly equal bf16 gradients."""
    from dflash_core.kernels import head_loss as head_loss_kernels
    calls = []
    kernels = head_loss_kernels.row_statistics

    def counted(*args):
        calls.append(args)
        return kernels(*args)

    monkeypatch.setattr(head_loss_kernels, "row_statistics", counted)
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden, vocab = 256, 5000
    h = torch.randn(2, 5, BLOCK_SIZE, hidden, device="cuda", generator=gen).bfloat16()
    head_weight = (torch.randn(vocab, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
    labels = torch.randint(0, vocab, (2, 5, BLOCK_SIZE), device="cuda", generator=gen)
    weights = (torch.rand(2, 5, BLOCK_SIZE, device="cuda", generator=gen) > 0.3).float()
    outs = []
    for compiled in (False, True):
        h_leaf = h.clone().requires_grad_(True)
        loss_sum, weight_sum, correct, *_ = FusedHeadLoss.apply(h_leaf, head_weight, labels, weights, 2, "dpace", 7.0,
                                                                0.5, compiled)
        loss_sum.backward()
        outs.append((loss_sum, weight_sum, correct, h_leaf.grad))
    (want_loss, want_weight, want_correct, want_grad), (loss, weight, correct, grad) = outs
    assert len(calls) == 3
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(weight, want_weight, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, want_correct)
    assert float((grad.float() - want_grad.float()).norm() / want_grad.float().norm()) < 1e-2
