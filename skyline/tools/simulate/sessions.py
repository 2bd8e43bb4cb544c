"""The multi-turn workload in the simulator: requests with a prefix identity (their block chain).

The bench's multi-turn workload (skyline/tools/bench/multiturn.py) sends text: conversations over a
shared system prompt whose every turn repeats the history, and RAG questions over a few shared
documents. A prefix cache sees only which leading blocks two prompts share, so the simulator needs
no text: each request gets synthetic token ids laid out as the bench's prompts are (system prompt,
then the history and its answers, then the new message; or the system prompt, a document and a
question), and carries the chain of its prompt + answer (scheduler/prefix.py `block_chain`, the
gateway's own hash), computed once when the workload is made. Simulated engines cache blocks of
those chains (prefix_cache.py) and the simulated gateway places requests on them. Requests of the
single-turn workloads carry no chain and cost nothing here.

Two sources:
- `synthetic`: sessions drawn like the bench's (`MultiturnSpec`: turns, think time, documents, the
  prompt bound); turns are closed-loop, each sent a think time after the previous answer ended
  (`SimRequest.next_turn`, sent by the simulated fleet); for plans of any size;
- `attach_chains`: a measured multi-turn run replayed (`load_trace`): its records give each turn's
  prompt and answer lengths and send times; the documents the RAG questions were about are
  regenerated from the bench's seed (`make_sessions` draws them from the same random stream
  whatever the tokenizer, so a byte tokenizer recovers which document each session asked about).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Sequence

from skyline.scheduler.prefix import chain_from
from skyline.tools.bench.oracle import oracle_of_chains
from skyline.tools.bench.multiturn import QUESTION_ROOM, MultiturnSpec, make_sessions
from skyline.tools.bench.workload import WorkloadSpec, arrival_offsets, class_sequence
from skyline.tools.simulate.request import SimRequest

# The bench's system prompt (multiturn.system_prompt) through SmolLM2's chat template: 136-139 tokens
# (the date line varies), counted with the model's tokenizer. One 128-token block on CPU engines.
SYSTEM_TOKENS = 136
QUESTION_TOKENS = 20  # "\n\nQuestion: ..." after a document, and the template's end: a RAG prompt's own part


def _fresh(rng: random.Random, n: int) -> list[int]:
    """`n` token ids no other prompt shares (a whole block of them never repeats by chance)."""
    return array("I", rng.randbytes(4 * max(0, n))).tolist()


def _chain(tokens: Sequence[int], block_size: int) -> tuple[str, ...]:
    return tuple(chain_from(None, tokens, block_size))


def _extend(chain: tuple[str, ...], tokens: Sequence[int], block_size: int) -> tuple[str, ...]:
    """The chain of `tokens`' full blocks, given `chain`, that of their leading full blocks: only the
    blocks after it are hashed (a turn's history was hashed with the turn before)."""
    done = len(chain)
    return chain + tuple(chain_from(chain[-1] if chain else None, tokens[done * block_size:], block_size))


def _request(index: int, cls: str, tier: str, send_at: float, prompt: list[int], answer: list[int],
             targets: tuple[float, float], block_size: int, known: tuple[str, ...] = ()) -> SimRequest:
    """`known`: the chain of the prompt's leading blocks already hashed (its history's, its document's)."""
    req = SimRequest(index, cls, tier, send_at, len(prompt), len(answer), *targets)
    req.chain = _extend(known, prompt + answer, block_size)
    req.prompt_blocks = len(prompt) // block_size
    return req


def synthetic(spec: WorkloadSpec, mt: MultiturnSpec, rate: float, n: int, targets: Callable[[str], tuple],
              block_size: int, system_tokens: int = SYSTEM_TOKENS) -> list[SimRequest]:
    """The first turns of `n` sessions at `rate` sessions/s, sorted by send time; each turn's next one
    hangs off it (`next_turn`, `think_s`), sent by the fleet once it is answered. `targets(cls)` ->
    (TTFT ms, TPOT ms). Lengths as the bench draws them: user messages `spec.chat_prompt` tokens,
    answers `spec.chat_output` / `spec.rag_output`, documents sized for `spec.rag_prompt` prompts."""
    rng = random.Random(f"{spec.seed}:sim-multiturn:{rate:g}")
    times = arrival_offsets(n, rate, random.Random(f"{spec.seed}:arrivals:{rate:g}"), spec.arrival, spec.burstiness)
    system = _fresh(rng, system_tokens)
    system_chain = _chain(system, block_size)
    room = system_tokens + QUESTION_ROOM
    docs = [system + _fresh(rng, max(0, min(rng.randint(*spec.rag_prompt), mt.max_prompt_tokens) - room))
            for _ in range(mt.rag_docs if spec.mix < 1 else 0)]
    doc_chains = [_chain(d, block_size) for d in docs]
    by_cls = {c: (spec.tier_of(c), targets(c)) for c in ("chat", "rag")}
    out, index = [], 0
    for i, cls in enumerate(class_sequence(n, spec.mix, rng.random())):
        tier, tgt = by_cls[cls]
        if cls == "rag":
            d = rng.randrange(len(docs))
            prompt = docs[d] + _fresh(rng, QUESTION_TOKENS)
            out.append(_request(index, cls, tier, times[i], prompt, _fresh(rng, rng.randint(*spec.rag_output)), tgt,
                                block_size, doc_chains[d]))
            out[-1].session, out[-1].turn = i, 0
            index += 1
            continue
        history, known, prev = system, system_chain, None
        for turn in range(rng.randint(*mt.turns)):
            prompt = history + _fresh(rng, rng.randint(*spec.chat_prompt))
            if len(prompt) > mt.max_prompt_tokens:
                break  # the conversation ends rather than send a prompt over the bound
            answer = _fresh(rng, rng.randint(*spec.chat_output))
            req = _request(index, cls, tier, times[i], prompt, answer, tgt, block_size, known)
            req.session, req.turn = i, turn
            index += 1
            if prev is None:
                out.append(req)
            else:
                prev.next_turn = req
                req.think_s = rng.expovariate(1 / mt.think_s) if mt.think_s > 0 else 0.0
            prev, history, known = req, prompt + answer, req.chain
    out.sort(key=lambda r: (r.send_at, r.index))
    return out


_CUT = "\x00"  # between a regenerated message's text and the suffix the bench keeps after cutting it
BYTES_PER_TOKEN = 5  # the corpus's prose in SmolLM2's tokens: 4.9 bytes a token (passages), 4.6 (questions)
USER_HEADER, USER_TAIL = (1, 2, 3), (4, 5, 6, 7, 8)  # the chat template around a user message, in tokens:
# "<|im_end|>\n<|im_start|>user\n" before it (the system prompt's end is in SYSTEM_TOKENS) and
# "<|im_end|>\n<|im_start|>assistant\n" after it; the same ids in every prompt, as the template's are


def _regenerated(workload: dict, rate: float, sessions: int) -> list:
    """The bench's sessions of a measured multi-turn run (`make_sessions`, its seed and spec). The
    builder leaves texts uncut (the bench cuts each to its length in the model's tokens, which the
    replay takes from the records) and draws from the random stream exactly as the bench's: the
    classes, turns, answer lengths, the passages each message starts with and the document each RAG
    session asked about are the run's."""
    from skyline.tools.bench.prompts import PromptBuilder
    from skyline.tools.bench.tokenizer import SimTokenizer

    class Uncut(PromptBuilder):
        def _fit(self, filler: str, suffix: str, target_tokens: int) -> tuple[str, int]:
            return filler + _CUT + suffix, target_tokens

    as_tuples = lambda d: {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    spec = WorkloadSpec(**as_tuples({k: v for k, v in workload.items() if k not in ("kind", "multiturn")}))
    mt = MultiturnSpec(**as_tuples(workload.get("multiturn") or {}))
    return make_sessions(spec, mt, Uncut(SimTokenizer()), sessions, rate)


def _checked(rows: Sequence[dict], workload: dict, rate: float) -> list:
    """The regenerated sessions of a measured run's records. Every record is checked against its
    session (class, answer length): a trace of another workload or seed fails here rather than
    replay the wrong prefixes."""
    built = _regenerated(workload, rate, 1 + max(int(r["session"]) for r in rows))
    for r in rows:
        s = built[int(r["session"])]
        turn = int(r.get("turn", 0))
        if s.cls != r.get("cls") or turn >= len(s.max_tokens) or s.max_tokens[turn] != int(r["max_tokens"]):
            raise ValueError(f"record {r.get('index')} (session {r['session']}, turn {turn}) is not the session "
                             f"the bench's seed makes: not this workload's trace")
    return built


def _text_ids(text: str) -> list[int]:
    """Token ids of a text, one per BYTES_PER_TOKEN bytes: two texts with a common start get common ids."""
    b = text.encode()
    return [int.from_bytes(b[i:i + BYTES_PER_TOKEN], "little") for i in range(0, len(b), BYTES_PER_TOKEN)]


def _message(user: str, tokens: int, rng: random.Random) -> list[int]:
    """A chat turn's new user message of `tokens` tokens, template included: the text the bench cut to
    that length (its start, then the question it keeps at the end)."""
    filler, _, suffix = user.partition(_CUT)
    n = max(0, tokens - len(USER_HEADER) - len(USER_TAIL))
    tail = _text_ids(suffix)[:n]
    body = _text_ids(filler)[:n - len(tail)]
    return [*USER_HEADER, *body, *_fresh(rng, n - len(body) - len(tail)), *tail, *USER_TAIL]


def attach_chains(rows: Sequence[dict], reqs: Sequence[SimRequest], workload: dict, rate: float,
                  block_size: int, system_tokens: int = SYSTEM_TOKENS) -> None:
    """Give the requests replayed from a measured multi-turn run (`rows`, their records; `reqs`, the
    same in the same order) the chains of their prompts and answers: every prompt starts with the
    rate's system prompt; a conversation's turn extends its history (prompt and answer before it)
    with its new message, whose text starts as the bench's did (messages that open with the same
    passage of the corpus share those tokens); RAG questions share their document. Lengths are the
    records' (prompt tokens as the server counted them, the answer's output tokens)."""
    rng = random.Random(f"sim-replay:{rate:g}")
    system = _fresh(rng, system_tokens)
    built = _checked(rows, workload, rate)
    texts: dict[str, int] = {}
    asked = {s.index: texts.setdefault(s.users[0].rsplit("\n\nQuestion: ", 1)[0], len(texts))
             for s in built if s.cls == "rag"}  # session -> its document
    doc_len: dict[int, int] = {}
    for r in rows:
        if r.get("cls") == "rag":
            d = asked[int(r["session"])]
            n = int(r.get("server_prompt_tokens") or r["prompt_tokens"]) - system_tokens - QUESTION_TOKENS
            doc_len[d] = min(doc_len.get(d, n), n)
    docs = {d: _fresh(rng, n) for d, n in sorted(doc_len.items())}
    order = sorted(range(len(rows)), key=lambda i: (int(rows[i]["session"]), int(rows[i].get("turn", 0))))
    history: dict[int, list[int]] = {}
    for i in order:
        r, req = rows[i], reqs[i]
        s, n, turn = int(r["session"]), req.prompt_tokens, int(r.get("turn", 0))
        if r.get("cls") == "rag":
            prompt = system + docs[asked[s]]
        else:
            prompt = history.get(s, system)
            prompt = prompt + _message(built[s].users[turn], n - len(prompt), rng)
        prompt = (prompt + _fresh(rng, n - len(prompt)))[:n]
        answer = _fresh(rng, int(r.get("output_tokens") or req.max_tokens))
        history[s] = prompt + answer
        req.chain = _chain(prompt + answer, block_size)
        req.prompt_blocks = n // block_size
        req.session, req.turn = s, turn


def add_oracle(reqs: Sequence[SimRequest], block_size: int) -> None:
    """Each completed request's oracle hit (what one infinite prefix cache would have served it, the
    bench's definition: `oracle_of_chains` over what was sent before its first token), where the
    workload did not bring a measured one (a replayed run keeps its own)."""
    done = [r for r in reqs if r.outcome == "ok" and r.chain is not None]
    if not done or all(r.oracle_cached_tokens is not None for r in done):
        return
    hits = oracle_of_chains([r.chain[:r.prompt_blocks] for r in done], [r.chain for r in done],
                            [r.prompt_tokens for r in done], block_size,
                            [(r.send_at, r.send_at + r.ttft_s) for r in done])
    for r, hit in zip(done, hits):
        if r.oracle_cached_tokens is None:
            r.oracle_cached_tokens = hit
