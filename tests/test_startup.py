import fp8
import startup


def test_the_start_up_table_tells_the_truth_about_compile_modes():
    assert startup.describe_compile("off", "cpu") == "off (not requested)"
    assert "CUDA graphs do not apply on cpu" in startup.describe_compile("reduce-overhead", "cpu")
    assert startup.describe_compile("reduce-overhead", "cuda") == "on, mode reduce-overhead"


def test_the_compile_row_says_when_transformer_engine_runs_eagerly_inside_it(monkeypatch):
    """Before TE is imported: torch's opaque-type API under torch 2.14's names, which TE 2.20's compiled path
    needs; after, TE's own record of why it switched that path off. Either way the row says why its modules run
    eagerly, so a slow TE step has its reason where the run starts."""
    import sys
    import types

    from torch._library import opaque_object
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch.utils", raising=False)
    for name in ("register_custom_class", "is_opaque_constant_type"):
        monkeypatch.delattr(opaque_object, name, raising=False)
    lacking = "this torch lacks the opaque-type API of torch 2.14 that TE's compiled path needs"
    assert fp8.te_compile_problem() == lacking
    assert startup.describe_compile("default", "cuda", te_blocks=True) == (
        f"on, mode default; Transformer Engine's modules run eagerly between its graphs ({lacking})")
    assert startup.describe_compile("default", "cuda") == "on, mode default"  # no TE blocks
    assert startup.describe_compile("off", "cuda", te_blocks=True) == "off (not requested)"
    for name in ("register_custom_class", "is_opaque_constant_type"):
        monkeypatch.setattr(opaque_object, name, lambda *args, **kwargs: None, raising=False)
    assert fp8.te_compile_problem() is None
    assert startup.describe_compile("default", "cuda", te_blocks=True) == "on, mode default"
    te_utils = types.SimpleNamespace(_compile_disabled_reason="could not register the custom op 'x'")
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.utils", te_utils)  # TE's word once imported
    row = startup.describe_compile("default", "cuda", te_blocks=True)
    assert row.endswith("graphs (could not register the custom op 'x')")
    te_utils._compile_disabled_reason = None
    assert fp8.te_compile_problem() is None
