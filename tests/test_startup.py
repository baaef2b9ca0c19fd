import startup


def test_the_start_up_table_tells_the_truth_about_compile_modes():
    assert startup.describe_compile("off", "cpu") == "off (not requested)"
    assert "CUDA graphs do not apply on cpu" in startup.describe_compile("reduce-overhead", "cpu")
    assert startup.describe_compile("reduce-overhead", "cuda") == "on, mode reduce-overhead"
