"""The memo of torch's kernel-access analysis (compile time): same kinds of arguments hit, any
difference that could change the analysis misses, unknown argument kinds are never memoised."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from sparse_fx.lowering.kernels import access_memo


def counting(result_of):
    calls = []

    def analysis(kernel, kwargs, tma_descriptor_metadata=None):
        calls.append((kernel, dict(kwargs)))
        return result_of(kernel, kwargs)

    return analysis, calls


def test_same_kinds_of_arguments_are_analysed_once_and_results_are_not_shared():
    analysis, calls = counting(lambda k, kw: [name for name, v in kw.items() if isinstance(v, torch.Tensor)])
    memo = access_memo.memoised(analysis, only=lambda kernel: True)
    kernel = object()
    with FakeTensorMode():
        a = dict(x=torch.empty(3, 4), out=torch.empty(7, dtype=torch.int32), n=5, BLOCK=64)
        b = dict(x=torch.empty(9, 2), out=torch.empty(1, dtype=torch.int32), n=5, BLOCK=64)  # other shapes only
    first, second = memo(kernel, a, {}), memo(kernel, b, tma_descriptor_metadata={})  # called either way
    assert first == second == ["x", "out"] and first is not second
    assert len(calls) == 1 and memo.sparse_fx_hits == 1
    first.append("changed")
    assert memo(kernel, a, {}) == ["x", "out"], "a caller's change leaks into the memo"


def test_anything_that_could_change_the_analysis_misses():
    analysis, calls = counting(lambda k, kw: sorted(kw))
    memo = access_memo.memoised(analysis, only=lambda kernel: True)
    kernel, other = object(), object()
    import triton.language as tl

    base = dict(x=torch.empty(2), n=5, BLOCK=64, flag=True, OP=tl.bfloat16)
    variants = [
        (kernel, {**base, "x": torch.empty(2, dtype=torch.float16)}),  # a dtype
        (kernel, {**base, "n": 1}),  # a scalar's value (specialisation on 1 and on 16)
        (kernel, {**base, "BLOCK": 128}),  # a constexpr
        (kernel, {**base, "flag": False}),
        (kernel, {**base, "OP": tl.float16}),  # a Triton dtype
        (other, base),  # another kernel
    ]
    memo(kernel, base, {})
    for k, kw in variants:
        memo(k, kw, {})
    assert len(calls) == 1 + len(variants) and memo.sparse_fx_hits == 0


def test_unknown_argument_kinds_and_descriptor_metadata_are_never_memoised():
    analysis, calls = counting(lambda k, kw: [])
    memo = access_memo.memoised(analysis, only=lambda kernel: True)
    kernel = object()
    for _ in range(2):
        memo(kernel, dict(x=torch.empty(2), obj=object()), {})
        memo(kernel, dict(x=torch.empty(2)), {"x": ("stable", ([16, 16],))})
    assert len(calls) == 4 and not memo.sparse_fx_memo


def test_installed_over_torchs_analysis_by_importing_the_kernels():
    from torch._higher_order_ops import triton_kernel_wrap

    names = [n for n in access_memo.ANALYSES if hasattr(triton_kernel_wrap, n)]
    assert names, f"torch {torch.__version__} has none of {access_memo.ANALYSES}: compile time loses the memo"
    assert all(hasattr(getattr(triton_kernel_wrap, n), "sparse_fx_memo") for n in names)
    access_memo.install()  # a second install wraps nothing twice
    assert all(not hasattr(getattr(triton_kernel_wrap, n).__wrapped__, "sparse_fx_memo") for n in names)


def test_only_our_kernels_are_memoised():
    import triton

    from sparse_fx.lowering.kernels.select import _select_kernel

    @triton.jit
    def users_kernel(x):
        pass

    assert access_memo.ours(_select_kernel) and not access_memo.ours(users_kernel) and not access_memo.ours(object())
    analysis, calls = counting(lambda k, kw: [])
    memo = access_memo.memoised(analysis)
    for _ in range(2):
        memo(users_kernel, dict(x=torch.empty(2)), {})
        memo(_select_kernel, dict(x=torch.empty(2)), {})
    assert [k for k, _ in calls] == [users_kernel, _select_kernel, users_kernel] and memo.sparse_fx_hits == 1


def test_our_kernels_are_analysed_without_their_launch_wait():
    """A kernel compiled with PDL has a wait at entry (inline assembly torch's analysis cannot walk,
    touching no memory): ours are analysed as with PDL 0, so PDL 0 and 1 share one analysis; another
    kernel's arguments reach the analysis as given."""
    analysis, calls = counting(lambda k, kw: [])
    memo = access_memo.memoised(analysis, only=lambda kernel: kernel == "ours")
    for pdl in (1, 0, 2):
        memo("ours", dict(x=torch.empty(2), PDL=pdl), {})
        memo("theirs", dict(x=torch.empty(2), PDL=pdl), {})
    assert [(k, kw["PDL"]) for k, kw in calls] == [("ours", 0), ("theirs", 1), ("theirs", 0), ("theirs", 2)]
    assert memo.sparse_fx_hits == 2


def test_a_kernel_launched_with_launch_options_hits_at_every_call_site():
    """torch wraps a kernel launched with num_warps (and kin) in a new single-config Autotuner at every
    call site: those count as the kernel they wrap with their configs' values, so layer after layer
    hits; other launch values, another kernel or a config with a hook miss or are not memoised."""
    import triton

    @triton.jit
    def kernel(x, n, BLOCK: triton.language.constexpr):
        pass

    @triton.jit
    def other(x, n, BLOCK: triton.language.constexpr):
        pass

    def site(fn, hook=None, **launch):  # as torch builds it at a call site: a new object each time
        return triton.autotune(configs=[triton.Config({}, pre_hook=hook, **launch)], key=[])(fn)

    analysis, calls = counting(lambda k, kw: ["x"])
    memo = access_memo.memoised(analysis, only=lambda kernel: True)
    args = dict(x=torch.empty(2), n=7, BLOCK=64)
    for _ in range(3):  # three layers
        assert memo(site(kernel, num_warps=4), dict(args), {}) == ["x"]
    assert len(calls) == 1 and memo.sparse_fx_hits == 2
    memo(site(kernel, num_warps=8), dict(args), {})
    memo(site(kernel, num_warps=4, num_stages=2), dict(args), {})
    memo(site(other, num_warps=4), dict(args), {})
    assert len(calls) == 4 and memo.sparse_fx_hits == 2
    for _ in range(2):
        memo(site(kernel, hook=lambda nargs: None, num_warps=4), dict(args), {})
    assert len(calls) == 6 and memo.sparse_fx_hits == 2 and len(memo.sparse_fx_memo) == 4
