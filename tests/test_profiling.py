import pytest

from launcher.bench.profiling import format_breakdown, format_top_kernels, kernel_breakdown, kernel_category


@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("triton_tem_fused_flex_attention_backward_transpose_view_1", "flex_backward"),
    ("triton_tem_fused_flex_attention_0", "flex_forward"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at_", "flash_backward"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_", "flash_forward"),
    ("row_stats_kernel", "head_loss"),
    ("adamw_kernel", "optimizer"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3", "compiled_glue"),
    ("Memcpy HtoD (Pageable -> Device)", "copy_fill"),
    ("void at::native::index_elementwise_kernel", "other"),
])
def test_kernels_fall_into_the_named_categories(name, category):
    assert kernel_category(name) == category


def test_breakdown_sums_per_step_and_books_the_rest_as_gaps():
    kernels = [("nvjet_a", 80.0), ("nvjet_a", 90.0), ("triton_tem_fused_flex_attention_backward_1", 30.0),
               ("triton_poi_fused_add_2", 10.0), ("multi_tensor_apply_kernel", 16.0)]
    breakdown = kernel_breakdown(kernels, step_ms=120.0, steps=2)
    assert breakdown["ms_per_step"] == {"gemm": 85.0, "flex_backward": 15.0, "optimizer": 8.0,
                                        "compiled_glue": 5.0}
    assert breakdown["kernel_ms_per_step"] == 113.0
    assert breakdown["gap_ms_per_step"] == pytest.approx(7.0)
    assert breakdown["top_kernels"][0] == {"name": "nvjet_a", "ms_per_step": 85.0}
    assert "gaps 7.0" in format_breakdown(breakdown)
    assert breakdown["top_kernels_by_category"]["gemm"] == [
        {"name": "nvjet_a", "ms_per_step": 85.0, "launches_per_step": 1.0}]
    assert "   5.000 ms    0.5x  triton_poi_fused_add_2" in format_top_kernels(breakdown)
    # Overlapping streams can sum to more than the wall time: the gap is then 0, never negative.
    assert kernel_breakdown(kernels, step_ms=100.0, steps=2)["gap_ms_per_step"] == 0.0
