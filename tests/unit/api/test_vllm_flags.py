"""Flags in spec.vllm.extraArgs are checked as vLLM reads them: '_' for '-', `=value`,
`.key`, abbreviations (argparse's allow_abbrev); `--config FILE` is refused; a literal secret
never reaches the pod spec in any spelling."""

import pathlib
import subprocess
import sys

import pytest
import yaml

from vlm_operator.api import crd, vllm_flags
from vlm_operator.api.admin_policy import AdminPolicy
from vlm_operator.api.validation import validate

ROOT = pathlib.Path(__file__).resolve().parents[3]


def cr(*args):
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"model": "m", "image": "reg.example/vllm/vllm-openai:v0.20.2",
                     "vllm": {"extraArgs": list(args)}}}


@pytest.mark.parametrize("arg, name", [
    ("--trust_remote_code", "--trust-remote-code"),
    ("--worker_extension_cls=evil.Ext", "--worker-extension-cls"),
    ("--hf_token.x", "--hf-token"),
    ("-tp=2", "-tp"),
    ("-tp.x", "-tp"),
    ("--", None), ("-", None), ("hf_abc", None), ("--=x", None),
])
def test_a_flag_is_named_as_vllm_rewrites_it(arg, name):
    assert vllm_flags.flag_name(arg) == name


@pytest.mark.parametrize("arg, named", [
    ("--hf_token", "--hf_token (to vLLM: --hf-token)"),
    ("--hf_token=hf_abc", "--hf_token (to vLLM: --hf-token)"),
    ("--hf-tok", "--hf-tok (to vLLM: --hf-token)"),
    ("--hf-token.x", "--hf-token.x (to vLLM: --hf-token)"),
    ("--max_model_len=8192", "--max_model_len (to vLLM: --max-model-len)"),
    ("--max-model", "--max-model (to vLLM: --max-model-len)"),
    ("--tensor_parallel_size", "--tensor_parallel_size (to vLLM: --tensor-parallel-size)"),
    ("-tp=2", "-tp"),
    ("-t", "-t (to vLLM: -tp)"),
    ("--served_model_name", "--served_model_name (to vLLM: --served-model-name)"),
    ("--por", "--por (to vLLM: --port)"),
])
def test_managed_flags_are_refused_in_every_spelling(arg, named):
    problems, _ = validate(cr(arg, "x"))
    assert len(problems) == 1
    assert problems[0].startswith(f"spec.vllm.extraArgs[0]: {named} is managed by the "
                                  "operator: ")


@pytest.mark.parametrize("args", [
    ["--api-key", "sk-live"], ["--api_key", "sk-live"], ["--api_key=sk-live"],
    ["--api-ke", "sk-live"], ["--api-key.x=sk-live"]])
def test_an_api_key_on_the_command_line_is_refused_in_every_spelling(args):
    problems, _ = validate(cr(*args))
    assert len(problems) == 1 and problems[0].startswith("spec.vllm.extraArgs[0]: --api")
    assert "takes a secret, which on the command line anyone who can read the pod reads: set " \
           "VLLM_API_KEY in spec.vllm.env from a Secret (valueFrom.secretKeyRef)" in problems[0]


@pytest.mark.parametrize("args", [
    ["--config", "/models/serve.yaml"], ["--config=/models/serve.yaml"],
    ["--conf", "/models/serve.yaml"], ["--config.port", "9000"]])
def test_a_config_file_is_refused(args):
    """Its keys are flags too (--port, --trust-remote-code, --hf-token ...), in a file in the
    pod the operator cannot read."""
    problems, _ = validate(cr(*args))
    assert len(problems) == 1 and problems[0].startswith("spec.vllm.extraArgs[0]: --conf")
    assert "reads more flags from a file in the pod, which the operator cannot read" in \
        problems[0]


@pytest.mark.parametrize("arg, flag", [
    ("--trust_remote_code", "--trust-remote-code"),
    ("--trust-remote", "--trust-remote-code"),
    ("--worker_extension_cls=evil.Ext", "--worker-extension-cls"),
    ("--worker-ext", "--worker-extension-cls"),
    ("--worker_cls", "--worker-cls"),
    ("--tool_parser_plugin", "--tool-parser-plugin"),
    ("--middle", "--middleware"),
    ("--logits_processors=evil.P", "--logits-processors"),
])
def test_code_options_are_refused_in_every_spelling(arg, flag):
    spec = cr("--enforce-eager", arg)
    assert validate(spec, AdminPolicy())[0] == []  # off by default
    problems, _ = validate(spec, AdminPolicy(deny_code_options=True))
    written = arg.split("=", 1)[0]
    assert problems == [f"spec.vllm.extraArgs[1]: {written} (to vLLM: {flag}) is not allowed "
                        "by the operator's policy: it " + problems[0].split(": it ", 1)[1]]


@pytest.mark.parametrize("arg", [
    "--enforce-eager", "--enforce_eager", "--max-num-seqs=8", "--config-format", "--convert",
    "--api-server-count", "--allow-credentials", "--logits-processor-pattern", "--tokenizer",
    "-pp", "-O3", "--kv-cache-dtype=fp8", "hf_abc", "--model-impl", "--hf-overrides.x=1"])
def test_other_flags_pass(arg):
    assert validate(cr(arg), AdminPolicy(deny_code_options=True)) == ([], [])


def test_render_keeps_a_token_out_of_the_pod_spec(tmp_path):
    """`vlm-operator render` of a token under vLLM's other spelling prints nothing."""
    path = tmp_path / "token.yaml"
    path.write_text(yaml.safe_dump(cr("--hf_token", "hf_SECRETVALUE")))
    result = subprocess.run([sys.executable, "-m", "vlm_operator.cli", "render", "-f",
                             str(path)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert result.stdout == "" and "hf_SECRETVALUE" not in result.stderr
    assert "spec.vllm.extraArgs[0]: --hf_token (to vLLM: --hf-token) is managed by the " \
           "operator" in result.stderr
