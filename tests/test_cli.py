import pytest
import yaml
from click.testing import CliRunner
from tiny_models import make_tiny_model, make_tokenizer

from specdeploy.cli.main import main


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def recipe_file(tmp_path, **changes):
    raw = yaml.safe_load(open("build/smollm2-135m-int8-draft.yaml"))
    for dotted, value in changes.items():
        node = raw
        *parents, last = dotted.split("__")
        for key in parents:
            node = node[key]
        node[last] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_help_lists_commands():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("check", "doctor", "models"):
        assert command in result.output


def test_check_prints_the_plan(tmp_path):
    result = run("--root", str(tmp_path), "check", "build/smollm2-135m-int8-draft.yaml")
    assert result.exit_code == 0, result.output
    for word in ("quantize target", "build draft", "repo", "serve", "validate", "missing"):
        assert word in result.output


def test_check_names_what_the_stages_would_refuse_here(tmp_path):
    """A bare model name that is neither bundled nor a folder is an error (quantize refuses it at once); missing input
    files and an EAGLE-3 head are named in the plan, and the head's line says where it comes from."""
    result = run("check", recipe_file(tmp_path, target__model="smollm2-135m-instruc"))
    assert result.exit_code == 2 and "model 'smollm2-135m-instruc' is neither a bundled model" in result.output
    assert "did you mean smollm2-135m-instruct?" in result.output
    result = run("--root", str(tmp_path), "check", "build/smollm2-135m.yaml")
    assert (
        result.exit_code == 0
        and "EAGLE-3 head: draft.head smollm2-135m-instruct-eagle3" in result.output
        and ": present" in result.output
    )
    assert "no draft model" in result.output
    path = recipe_file(tmp_path, validation__prompt_set=str(tmp_path / "gone.jsonl"))
    result = run("--root", str(tmp_path), "check", path)
    assert result.exit_code == 0 and "gone.jsonl (NOT on this machine" in result.output


def test_check_unknown_key_is_a_usage_error(tmp_path):
    result = run("check", recipe_file(tmp_path, colour="red"))
    assert result.exit_code == 2
    assert "unknown key 'colour'" in result.output


def test_check_num_draft_tokens_over_max(tmp_path):
    result = run("check", recipe_file(tmp_path, speculative__num_draft_tokens=9, speculative__max_draft_len=4))
    assert result.exit_code == 2
    assert "num_draft_tokens' is 9" in result.output and "hint:" in result.output


def test_check_tokenizer_mismatch(tmp_path, tiny_llama_dir):
    make_tokenizer(tmp_path / "tok", vocab_size=300)
    make_tiny_model(tmp_path / "draft", tmp_path / "tok")
    path = recipe_file(tmp_path, target__model=str(tiny_llama_dir), draft__model=str(tmp_path / "draft"))
    result = run("check", path)
    assert result.exit_code == 2
    assert "draft tokenizer" in result.output and "one tokenizer" in result.output


def test_check_local_pair_ok(tmp_path, tiny_llama_dir, tiny_llama_draft_dir):
    path = recipe_file(tmp_path, target__model=str(tiny_llama_dir), draft__model=str(tiny_llama_draft_dir))
    result = run("--root", str(tmp_path), "check", path)
    assert result.exit_code == 0, result.output
    assert "share one tokenizer" in result.output


def test_missing_recipe_file():
    result = run("check", "build/does-not-exist.yaml")
    assert result.exit_code == 2
    assert "not found" in result.output


def test_verbose_shows_traceback(tmp_path):
    result = CliRunner().invoke(main, ["-v", "check", recipe_file(tmp_path, colour="red")])
    assert result.exit_code == 2
    assert "Traceback" in result.output


def test_doctor_prints_one_line_per_check():
    result = run("doctor")
    assert result.exit_code == 0
    for what in ("python", "torch", "GPU", "modelopt", "tritonserver", "shared memory", "free ports", "cache dir"):
        assert what in result.output


def test_doctor_names_the_kernels_this_cpu_gets(monkeypatch):
    from specdeploy.engine import lm_screen, native

    if not native.cpu_supported():
        pytest.skip("no native kernels on this CPU")
    monkeypatch.delenv(lm_screen.KIND_ENV, raising=False)
    for variant, kind in ((native.INT8_AVX2, "w8a16"), (native.INT8_AVX512_VNNI, "int8")):
        monkeypatch.setattr(native, "int8_variant", lambda v=variant: v)
        out = run("doctor").output
        assert f"int8 {native.INT8_VARIANT_NAMES[variant]}, greedy LM screen {kind}" in out, out


def test_models_list():
    result = run("models", "list")
    assert result.exit_code == 0
    assert "smollm2-135m-instruct" in result.output
