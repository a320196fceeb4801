"""benchmarks.step_host_costs: its "before" forms (index_copy_ K/V writes, the residual add on its
own, float32 logits and the blocked argmax, q/k/v split in Python, integer bf16 rounding) give
the same greedy tokens as the engine's forms, step by step in one engine, and switching back
restores every form."""

from __future__ import annotations

import pytest

from benchmarks import step_host_costs as bench
from engine.models.cpu_elementwise import load_cpu_elementwise
from engine.request import SamplingParams


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_forms_give_the_same_tokens_and_the_switch_restores_them(
        dtype, workload_prompts):
    before = load_cpu_elementwise()  # the rounding's two forms are tested in test_cpu_elementwise
    if before is None:
        pytest.skip("no native element-wise kernels here: nothing to switch")
    outputs = []
    for form in (False, True):
        engine = bench.engine_for(dtype, 4)
        forms = bench.Forms(engine, before)
        forms.use(form)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(workload_prompts[:4]):
            engine.add_request(prompt[:40], params, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outputs.append([done[str(i)] for i in range(4)])
        forms.use(True)
        assert bench.LlamaModel.forward is forms.forward
        assert engine.runner.model.elementwise.native is forms.modules[True]
        assert bench.cpu_elementwise.NativeCpuElementwise.defers_residual is True
        assert engine.runner.attention.write_kv == forms.write_kv
        del engine
    assert outputs[0] == outputs[1]
