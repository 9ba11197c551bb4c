"""Streams are exact: at every step the text a stream has shown is a prefix of the final text, with stop
strings that span 2-3 tokens, several samples, min_tokens, include_stop_str_in_output and unicode stop
strings split inside a character. Real SmolLM2 tokenizer, scripted engine (chosen outputs)."""

from __future__ import annotations

import pytest

from services.contracts.step_protocol import EngineInfo, ModelRunnerOutput, SchedulerOutput
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from services.scheduler.detokenizer import IncrementalDetokenizer
from tests.scheduler.conftest import shared_tokenizer

EOS = 2


class ScriptedExecutor:
    """Emits, for each request, the tokens of a chosen text (sample j: text j), then EOS; honours bans."""

    url = instance = "scripted"

    def __init__(self, scripts: dict[str, list[list[int]]], num_blocks: int = 256, block_size: int = 4):
        self.info = EngineInfo("scripted", block_size, num_blocks, 4096, 49152, "float32", "cpu", [EOS])
        self.scripts = scripts
        self.banned_seen: list[list[int]] = []

    def handshake(self):
        return self.info

    def probe(self, timeout=1.0):
        return self.instance

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput(out.step_id)
        for s in out.sequences:
            if not s.sample:
                continue
            rid = s.seq_id.split("#")[0]
            toks = []
            for j in range(s.num_samples):
                script = self.scripts[rid][(s.sample_index + j) % len(self.scripts[rid])]
                t = script[s.output_index] if s.output_index < len(script) else EOS
                if t in s.banned_token_ids:
                    t = 100 + s.output_index  # what a masked sampler picks instead of EOS
                toks.append(t)
            if s.banned_token_ids:
                self.banned_seen.append(list(s.banned_token_ids))
            result.sampled[s.seq_id] = toks
        return result


def run_streaming(texts: list[str], params: SamplingParams, rid: str = "r") -> tuple[list[list[str]], list]:
    """Every streamed snapshot of each sample's text, and the final outputs."""
    tok = shared_tokenizer()
    ex = ScriptedExecutor({rid: [tok.encode(t) for t in texts]})
    core = SchedulerCore(ex, tok, max_num_seqs=8)
    core.add_request(rid, tok.encode("Say something:"), params, stream=True)
    snapshots: list[list[str]] = [[] for _ in range(params.n)]
    final = None
    while core.has_unfinished():
        for out in core.step():
            for o in out.outputs:
                snapshots[o.index].append(o.text)
            if out.finished:
                final = out
    assert core.pool.num_in_use == 0
    return snapshots, final.outputs


def assert_exact(snapshots: list[str], final: str) -> None:
    for shown in snapshots:
        assert final.startswith(shown), f"streamed {shown!r}, but the final text is {final!r}"


TEXT = "The quick brown fox jumps over the lazy dog. Then it sleeps."


@pytest.mark.parametrize("stop", ["lazy dog", " jumps over", "sleeps.", "dog. Then", "o", "fox j"])
@pytest.mark.parametrize("include", [False, True])
def test_multi_token_stop_strings_never_leak_into_the_stream(stop, include):
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=include)
    snaps, outs = run_streaming([TEXT], params)
    at = TEXT.index(stop)
    want = TEXT[:at + len(stop)] if include else TEXT[:at]
    assert outs[0].text == want and outs[0].finish_reason == "stop" and outs[0].stop_reason == stop
    assert_exact(snaps[0], want)
    if not include:
        assert all(stop not in s for s in snaps[0])


def test_several_samples_each_stream_exactly():
    texts = [TEXT, "Stop right here, said the fox.", "Nothing to stop for at all"]
    params = SamplingParams(n=3, temperature=0, max_tokens=30, stop=["here", "lazy"])
    snaps, outs = run_streaming(texts, params)
    finals = [o.text for o in outs]
    assert finals == ["The quick brown fox jumps over the ", "Stop right ", texts[2]]
    for s, f in zip(snaps, finals, strict=True):
        assert_exact(s, f)


def test_min_tokens_masks_eos_and_defers_stop_strings():
    tok = shared_tokenizer()
    short = "Hi. Bye."
    n_short = len(tok.encode(short))
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=n_short + 3, stop=["Hi"])
    ex = ScriptedExecutor({"r": [tok.encode(short)]})
    core = SchedulerCore(ex, tok, max_num_seqs=8)
    core.add_request("r", tok.encode("x"), params, stream=True)
    shown, final = [], None
    while core.has_unfinished():
        for out in core.step():
            shown.append(out.outputs[0].text)
            final = out
    o = final.outputs[0]
    # "Hi" lies before min_tokens: never applied; EOS was masked until min_tokens tokens were out.
    assert len(o.token_ids) >= n_short + 3 and o.text.startswith(short)
    assert ex.banned_seen and all(EOS in b for b in ex.banned_seen)
    assert_exact(shown, o.text)


def test_min_tokens_with_ignore_eos_bans_only_stop_token_ids():
    tok = shared_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, ignore_eos=True, stop_token_ids=[7])
    ex = ScriptedExecutor({"r": [[7, 7, 7, 7, 7, 7]]})
    core = SchedulerCore(ex, tok, max_num_seqs=8)
    core.add_request("r", tok.encode("x"), params)
    while core.has_unfinished():
        core.step()
    assert ex.banned_seen == [[7]] * 4


@pytest.mark.parametrize("stop", ["é", "日本", "😀", "ü!"])
def test_unicode_stop_strings_split_inside_a_character(stop):
    tok = shared_tokenizer()
    text = f"Voilà ça va {stop} très bien {stop} fin"
    ids = tok.encode(text)
    # The stop string's bytes really are split over several tokens somewhere in this text.
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids))), "no split character"
    snaps, outs = run_streaming([text], SamplingParams(temperature=0, max_tokens=60, stop=[stop]))
    assert outs[0].text == text[:text.index(stop)]
    assert_exact(snaps[0], outs[0].text)
    assert all("\ufffd" not in s for s in snaps[0])


def test_hold_back_is_only_a_possible_stop_prefix():
    tok = shared_tokenizer()
    det = IncrementalDetokenizer(tok.fast, [], ["STOP here"])
    for t in tok.encode("We will ST"):
        det.add(t)
    assert det.text == "We will ST" and det.visible == "We will "
    for t in tok.encode("OMP go"):
        det.add(t)
    assert det.visible == det.text == "We will STOMP go"
