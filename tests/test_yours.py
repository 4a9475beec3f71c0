"""Your engine (issue 56): notebook 06 assembles ``LLM`` from the parts a participant passed (kept by
``kvlab.check``) and kvlab's for the rest. With every part kept it serves the capstone workload token for
token as kvlab's engine; with none it is kvlab's and says so; a kept part that passed its checker but
changes the engine is found by request, step and name; a part that raises stops the run in one line; a
stale or damaged record is refused by name."""

import json
import random
import re

import pytest
import torch

from kvlab import capstone as C
from kvlab import check
from kvlab.calibrate import calibrate, default_calibration
from kvlab.check import kept
from kvlab.bench.engine import make_workload
from kvlab.engine import scheduler
from kvlab.yours import ENGINE_PARTS, KERNEL_PARTS, YourEngine
from kvlab import kernels

if kernels.available():
    import triton
    import triton.language as tl

    @triton.jit
    def block_walk(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
        blk = tl.load(table_ptr + seq * s_table + page).to(tl.int64)
        slot = tl.arange(0, BLOCK_SIZE)
        return blk * s_blk + slot * s_tok + head * s_head, page * BLOCK_SIZE + slot < seq_len

    @triton.jit
    def online_softmax_update(m, l, acc, s, v, v_scale):
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + tl.sum((p * v_scale[None, :])[:, :, None] * v[None, :, :], axis=1)
        return m_new, l * alpha + tl.sum(p, axis=1), acc

    @triton.jit
    def dequant_int8(codes, scale):
        return codes.to(tl.float32) * scale

    @triton.jit
    def update_base2(m, l, acc, s, v, v_scale):  # the Triton tutorial's way: m in log2 units, exp2
        t = s * 1.4426950408889634
        m_new = tl.maximum(m, tl.max(t, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(t - m_new[:, None])
        acc = acc * alpha[:, None] + tl.sum((p * v_scale[None, :])[:, :, None] * v[None, :, :], axis=1)
        return m_new, l * alpha + tl.sum(p, axis=1), acc


# ---- a participant's answers, as they would write them in notebooks 02-04 ---------------------------------

def slot_mapping(block_table, block_size, start, end):
    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]


def append_slot(block_table, num_tokens, block_size, ref_count, take_block):
    copy = None
    if num_tokens % block_size == 0:
        block_table.append(take_block())
    elif ref_count(block_table[-1]) > 1:
        copy = (block_table[-1], take_block())
        block_table[-1] = copy[1]
    return block_table[-1] * block_size + num_tokens % block_size, copy


def prefix_hits(token_ids, block_size, cached, block_hash):
    hits, key = [], None
    for i in range((len(token_ids) - 1) // block_size):
        key = block_hash(key, token_ids[i * block_size:(i + 1) * block_size])
        if key not in cached:
            break
        hits.append(cached[key])
    return hits


def quantize_static(x, scale):
    return torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8)


def admission_rule(num_running, max_num_seqs, budget_left, blocks_needed, blocks_free, watermark_blocks):
    if budget_left <= 0:
        return "token budget"
    if num_running >= max_num_seqs:
        return "seq limit"
    if blocks_needed > blocks_free - (watermark_blocks if num_running else 0):
        return "no blocks"
    return None


def schedule_decodes(running, decoding, append, preempt):
    out = []
    for sid in list(running):
        if sid not in running or sid not in decoding:
            continue
        while not append(sid):
            victim = running[-1]
            preempt(victim)
            if victim == sid:
                break
        if sid in running:
            out.append(sid)
    return out


def chunk_prefills(uncomputed, budget):
    out = []
    for n in uncomputed:
        out.append(min(n, budget))
        budget -= out[-1]
    return out


def slot_mapping_capped(block_table, block_size, start, end):  # right while a sequence holds at most 8 blocks
    return [block_table[min(t // block_size, 7)] * block_size + t % block_size for t in range(start, end)]


def chunk_prefills_raising(uncomputed, budget):  # fails once a step's budget is partly spent
    if budget < 256:
        raise IndexError("list index out of range")
    out = []
    for n in uncomputed:
        out.append(min(n, budget))
        budget -= out[-1]
    return out


def chunk_prefills_helped(uncomputed, budget):  # leans on a helper of the notebook's, which is not kept
    return chunk_prefills(uncomputed, budget)


def quantize_static_narrow(x, scale):  # clamps one code short
    return torch.clamp(torch.round(x.float() / scale), -126, 126).to(torch.int8)


def admission_rule_strict(num_running, max_num_seqs, budget_left, blocks_needed, blocks_free, watermark_blocks):
    if budget_left <= 0:
        return "token budget"
    if num_running >= max_num_seqs - 1:  # one seat short
        return "seq limit"
    if blocks_needed > blocks_free - (watermark_blocks if num_running else 0):
        return "no blocks"
    return None


def append_slot_eager(block_table, num_tokens, block_size, ref_count, take_block):  # a new block one token early
    if num_tokens % block_size == block_size - 1 or not block_table:
        block_table.append(take_block())
        return block_table[-1] * block_size, None
    return block_table[-1] * block_size + num_tokens % block_size, None


def slot_mapping_gen(block_table, block_size, start, end):  # a generator: right, read once
    return (block_table[t // block_size] * block_size + t % block_size for t in range(start, end))


def append_slot_list(block_table, num_tokens, block_size, ref_count, take_block):  # a list, not a tuple
    if num_tokens % block_size == 0:
        block_table.append(take_block())
    return [block_table[-1] * block_size + num_tokens % block_size, None]


def append_slot_off(block_table, num_tokens, block_size, ref_count, take_block):  # one slot too far on
    if num_tokens % block_size == 0:
        block_table.append(take_block())
    return block_table[-1] * block_size + num_tokens % block_size + 1, None


def _pass_all(names):
    """Each part through its own checker, as a participant passing the task: the checker keeps it."""
    for name in names:
        assert getattr(check, name)(globals()[name]), name


# ---- the capstone workload (SmolLM2, notebook 06's 48 requests) --------------------------------------------

@pytest.fixture(scope="module")
def capstone(smollm2):
    model, tok = smollm2
    cal = default_calibration(model, tok, "smollm2-135m", tokens=1024, progress=False)
    wl = make_workload(tok, **C.WORKLOAD)
    fp16_block, _ = C.block_bytes(model, "fp16")
    p = C.plan(model, "paged INT8", 4 * 16 * fp16_block, 256, calibration=cal)  # notebook 06's budget and plan
    return model, tok, cal, wl, p, C.serve(C.make_engine(model, tok, p, cal), wl.prompts, wl.output_lens, p, 256)


def test_every_part_kept_serves_the_capstone_as_kvlabs_engine(capstone, capsys):
    model, tok, cal, wl, p, theirs = capstone
    _pass_all(ENGINE_PARTS)
    capsys.readouterr()
    mine = YourEngine(model, tok, p, cal)
    said = capsys.readouterr().out
    assert said.startswith("your engine: 7 of 7 parts yours: slot_mapping (02)")
    assert "fails today's check." not in said  # every part passes today's checkers too
    assert mine.parts == dict.fromkeys(ENGINE_PARTS, "yours") and mine.llm.scheduler.chunk_prefills is not \
        scheduler.chunk_prefills
    yours = mine.serve(wl.prompts, wl.output_lens, 256)
    got = mine.compare(theirs, yours)
    assert got["equal"] == 48 and yours["tokens"] == theirs["tokens"] and got["first"] is None
    assert yours["decisions"] == theirs["decisions"] and got["decision"] is None
    assert yours["held_at_limit"] == theirs["held_at_limit"] and yours["steps"] == theirs["steps"]
    assert set().union(*mine.ran.values()) == set(ENGINE_PARTS)  # every part ran
    assert "your engine against kvlab's on the same 48 requests: answers equal 48/48;" in capsys.readouterr().out
    assert not mine.disagreed


def test_a_planted_part_is_found_by_request_step_and_name(capstone, capsys):
    """A slot mapping capped at 8 blocks passed the checker's tables (none was longer, until this test found
    it: the checker now has one) and corrupts the capstone's longest requests."""
    model, tok, cal, wl, p, theirs = capstone
    assert not check.slot_mapping(slot_mapping_capped)  # the checker gained the case
    _pass_all(["append_slot", "admission_rule"])
    kept.keep("slot_mapping", slot_mapping_capped)  # as if passed before the checker had the case
    mine = YourEngine(model, tok, p, cal)
    yours = mine.serve(wl.prompts, wl.output_lens, 256)
    got = mine.compare(theirs, yours)
    out = capsys.readouterr().out
    first = got["first"]
    assert got["equal"] < 48 and first is not None and "slot_mapping" in first["parts"]
    i, j = first["request"], first["token"]
    assert yours["tokens"][i][:j] == theirs["tokens"][i][:j] and yours["tokens"][i][j] != theirs["tokens"][i][j]
    assert len(wl.prompts[i]) + j > 8 * 16  # only past the eighth block
    for k, (a, b) in enumerate(zip(yours["tokens"], theirs["tokens"])):  # no other request differs earlier
        d = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert d is None or mine.token_steps[k][d] >= first["step"]
    assert f"the answers first differ at request {i}, token {j} of its answer, step {first['step']} (" in out
    assert "Traceback" not in out
    # kept before its checker gained the case: named before the run, by today's checker, and still run as kept
    assert "your slot_mapping fails today's check.slot_mapping: " in out and "check.forget('slot_mapping')" in out
    assert out.count("fails today's check.") == 1
    # the wrong part named by what it returned: the first call past the eighth block, on kvlab's input
    assert list(got["disagreed"]) == ["slot_mapping"]
    step, what = got["disagreed"]["slot_mapping"]
    assert step <= first["step"] and ", block_size=16, start=128, end=129): yours [" in what
    assert re.search(rf"your slot_mapping first returned other than kvlab's in step {step}, for request \d+ \(block_table=\[", out)
    assert out.index("your slot_mapping first returned") < out.index("the answers first differ")


# ---- the tiny model: small workloads, each question on its own ----------------------------------------------

MAX_LEN = 64


def _workload(n=10, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(3, 259) for _ in range(9)]
    prompts = [system + [rng.randrange(3, 259) for _ in range(rng.randint(3, 20))] for _ in range(n)]
    return prompts, [rng.randint(3, 14) for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tiny):
    model, tok = tiny
    cal = calibrate(model, _workload(4, seed=9)[0], progress=False)
    per, _ = C.block_bytes(model, "fp16", 4)
    p = C.plan(model, "paged INT8", 2 * (MAX_LEN // 4) * per, MAX_LEN, block_size=4, calibration=cal)
    prompts, outs = _workload()
    theirs = C.serve(C.make_engine(model, tok, p, cal), prompts, outs, p, MAX_LEN)
    return model, tok, cal, p, prompts, outs, theirs


def test_with_no_kept_parts_your_engine_is_kvlabs_and_says_so(setup, capsys):
    model, tok, cal, p, prompts, outs, theirs = setup
    mine = YourEngine(model, tok, p, cal)
    assert "your engine is kvlab's: none of its 7 parts is yours yet" in capsys.readouterr().out
    assert set(mine.parts.values()) == {"kvlab's"} and mine.title == "your engine is kvlab's"
    assert mine.llm.scheduler.admission_rule is scheduler.admission_rule
    yours = mine.serve(prompts, outs, MAX_LEN)
    assert yours["tokens"] == theirs["tokens"] and yours["decisions"] == theirs["decisions"] and not mine.ran


@pytest.mark.parametrize("name, planted, shows", [
    ("quantize_static", "quantize_static_narrow", "values differ, first at ("),
    ("admission_rule", "admission_rule_strict", ": yours 'seq limit', kvlab's None"),
    ("append_slot", "append_slot_eager", "for (block_table=[")])
def test_a_part_is_held_to_kvlabs_on_the_inputs_it_gets(setup, capsys, name, planted, shows):
    """Call by call, each part (but schedule_decodes) is run beside kvlab's on the same input: the first call
    where they differ is reported with that input, so the wrong part is found by name."""
    model, tok, cal, p, prompts, outs, theirs = setup
    kept.keep(name, globals()[planted])
    mine = YourEngine(model, tok, p.__class__(**{**p.__dict__, "num_blocks": 14, "max_num_seqs": 4}), cal)  # tight
    got = mine.compare(C.serve(C.make_engine(model, tok, mine.plan, cal), prompts, outs, mine.plan, MAX_LEN),
                       mine.serve(prompts, outs, MAX_LEN))
    out = capsys.readouterr().out
    assert list(got["disagreed"]) == [name] and shows in got["disagreed"][name][1]
    assert f"your {name} first returned other than kvlab's in step {got['disagreed'][name][0]}, for (" in out


def test_right_answers_in_other_shapes_are_not_called_different(setup, capsys):
    """A generator of slots, an (slot, copy) list: what the engine accepts, the comparison accepts too."""
    model, tok, cal, p, prompts, outs, theirs = setup
    for name, fn in (("slot_mapping", slot_mapping_gen), ("append_slot", append_slot_list)):
        kept.keep(name, fn)
    mine = YourEngine(model, tok, p, cal)
    got = mine.compare(theirs, mine.serve(prompts, outs, MAX_LEN))
    assert got["equal"] == len(prompts) and not got["disagreed"], capsys.readouterr().out


def test_an_error_is_blamed_on_the_part_that_raised_it(setup, capsys):
    """kvlab's own check refusing what your append_slot returned, inside your schedule_decodes' call of append:
    the engine stopped, not your schedule_decodes raising; your append_slot's answer is named."""
    model, tok, cal, p, prompts, outs, theirs = setup
    _pass_all(["schedule_decodes"])
    kept.keep("append_slot", append_slot_off)
    mine = YourEngine(model, tok, p, cal)
    assert mine.serve(prompts, outs, MAX_LEN) is None
    out = capsys.readouterr().out
    assert "[stopped] your engine stopped in step" in out and "your schedule_decodes raised" not in out
    assert "your append_slot first returned other than kvlab's in step" in out


def test_the_quantizer_checker_gained_the_case_the_engine_found(capsys):
    """x * (1 / scale) passed quantize_static's checker; in notebook 06's engine its first write differed from
    kvlab's in 1 of 49,152 codes (answers still equal): the checker now has such values and names the slip."""
    def quantize_static_reciprocal(x, scale):
        return torch.clamp(torch.round(x.float() * (1.0 / scale)), -127, 127).to(torch.int8)
    assert not check.quantize_static(quantize_static_reciprocal)
    assert "divide by the scale: x * (1 / scale) rounds to the neighbouring code" in capsys.readouterr().out
    assert check.quantize_static(quantize_static)


def test_a_part_that_raises_stops_the_run_in_one_line(setup, capsys):
    model, tok, cal, p, prompts, outs, theirs = setup
    kept.keep("chunk_prefills", chunk_prefills_raising)
    mine = YourEngine(model, tok, p, cal)
    assert mine.serve(prompts, outs, MAX_LEN) is None
    out = capsys.readouterr().out
    assert "[stopped] your chunk_prefills raised IndexError in step" in out and "list index out of range" in out
    assert mine.compare(theirs, None)["equal"] is None
    assert "your engine: not compared, it stopped (above)" in capsys.readouterr().out
    kept.keep("chunk_prefills", chunk_prefills_helped)
    mine = YourEngine(model, tok, p, cal)
    assert mine.serve(prompts, outs, MAX_LEN) is None
    assert ("your chunk_prefills raised NameError in step 1: name 'chunk_prefills' is not defined (a kept part "
            "runs on its own: define what it uses inside it)") in capsys.readouterr().out


def test_stale_and_damaged_parts_are_refused_by_name_and_kvlabs_run(setup, capsys):
    model, tok, cal, p, prompts, outs, theirs = setup
    _pass_all(["admission_rule", "slot_mapping"])
    data = json.loads(kept.kept_file().read_text())
    data["admission_rule"]["signature"] = ["num_running", "budget_left"]  # another kvlab's task
    data["slot_mapping"]["jit"] = "yes"  # damaged
    kept.kept_file().write_text(json.dumps(data))
    capsys.readouterr()
    mine = YourEngine(model, tok, p, cal)
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("[refused]")] == [
        "[refused] your slot_mapping (02 Task 1): its record is damaged; kvlab's runs in its place",
        "[refused] your admission_rule (04 Task 1): written for another version of the task, (num_running, "
        "budget_left); the task now takes (num_running, max_num_seqs, budget_left, blocks_needed, blocks_free, "
        "watermark_blocks); kvlab's runs in its place"]
    assert mine.parts["slot_mapping"] == mine.parts["admission_rule"] == "refused"
    assert mine.serve(prompts, outs, MAX_LEN)["tokens"] == theirs["tokens"]


def test_your_engine_needs_a_paged_plan(setup):
    model, tok, cal, *_ = setup
    with pytest.raises(ValueError, match="paged plan"):
        YourEngine(model, tok, C.plan(model, "static FP16", 10**6, MAX_LEN, block_size=4), cal)


@pytest.mark.triton
def test_your_kernel_parts_decode_as_kvlabs_engine(setup, capsys):
    """The skeleton kernel with a participant's walk, update and dequantization decodes the INT8 pool (the own
    token at full precision, folded in by the kernel's log-sum-exp) as kvlab's PyTorch path, token for token."""
    model, tok, cal, p, prompts, outs, theirs = setup
    _pass_all(KERNEL_PARTS)
    few = prompts[:3]
    kvlabs = C.serve(C.make_engine(model, tok, p, cal), few, [4] * 3, p, MAX_LEN)
    mine = YourEngine(model, tok, p, cal, kernel=True)
    assert [mine.parts[n] for n in KERNEL_PARTS] == ["yours"] * 3
    yours = mine.serve(few, [4] * 3, MAX_LEN)
    capsys.readouterr()
    assert mine.compare(kvlabs, yours)["equal"] == 3
    said = capsys.readouterr().out  # the two runs' times are not alike: one interpreted kernel, one PyTorch path
    assert ("(yours in Triton's interpreter, kvlab's on PyTorch)" in said) == (kernels.triton_mode() == "interpreter")
    assert set().union(*mine.ran.values()) == set(KERNEL_PARTS)
    # an update in base 2 (the Triton tutorial's) passes its checker and folds the own token in alike
    assert check.online_softmax_update(update_base2)
    mine = YourEngine(model, tok, p, cal, kernel=True)
    assert mine.compare(kvlabs, mine.serve(few, [4] * 3, MAX_LEN))["equal"] == 3


def test_a_recheck_records_nothing_and_keeps_nothing(capsys):
    """Today's checker run over a kept part (YourEngine does it for each) is silent: a pass is not recorded again,
    a fail drops nothing; it returns the checker's reason, or None."""
    from kvlab.yours import recheck
    kept.keep("slot_mapping", slot_mapping_capped)  # kept before the checker had the 9th block
    before = (json.dumps(kept._load(), sort_keys=True), check.progress_file().read_text() if check.progress_file().exists() else "")
    capsys.readouterr()
    why = recheck("slot_mapping", slot_mapping_capped)
    assert why is not None and why.endswith("(first difference at index 128: yours 512, expected 720)")
    assert recheck("chunk_prefills", chunk_prefills) is None
    assert capsys.readouterr().out == ""
    after = (json.dumps(kept._load(), sort_keys=True), check.progress_file().read_text() if check.progress_file().exists() else "")
    assert after == before
