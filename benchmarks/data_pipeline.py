"""Preparing a corpus larger than memory into the token store, and feeding training from it.

    .venv/bin/python benchmarks/data_pipeline.py                        # 1 GB of generated text
    .venv/bin/python benchmarks/data_pipeline.py --source $DATA/brown/train.txt
    .venv/bin/python benchmarks/data_pipeline.py --size-mb 64 --small-mb 16 --steps 3   # a quick look

Prints one line per phase:
  corpus       --source (default: generated Zipfian text) repeated until --size-mb, with --novel-rate of its
               words replaced by fresh random words in every copy. Without them every word after the first copy
               would hit the tokenizer's piece cache (`encoding.PieceCache`); a natural corpus keeps bringing
               new words (the default 1% is about the share of first occurrences in a GB of English);
  tokenizer    a WordPiece tokenizer of --vocab tokens trained on one copy of the text; with --whole-tokenizer
               also on the whole small corpus as `train.py` trains one (without config.data.tokenizer), from a
               `text.DocumentStream` and, for comparison, from a list of its documents, each in a fresh process:
               seconds, peak resident memory (VmHWM), and whether the two vocabularies agree;
  prepare      `packing.load_or_pack` on an empty cache (read, tokenize with worker processes, write the store):
               MB of text per second (wall clock), CPU seconds of this process and its workers, and the peak
               resident memory of the process tree (VmRSS summed over it, sampled every 50 ms);
  train input  in a fresh process, as `train.py` reads its data: open the store (a cache hit), then
               `batches.train_batch` for --batches steps of --batch x --seq-len: host milliseconds per batch,
               and the process's own resident memory (RssAnon: file pages of the memory map are the page
               cache's, shown apart as VmRSS) before and after; once for the full corpus and once for a
               --small-mb one, so that growth with the corpus shows;
  step         the `configs/deberta.py:tiny` train step at that shape (jitted as `train.py` jits it): seconds
               per step alone; the host's batch time as a share of it; and whole loops of --steps steps,
               `train.py`'s (batch, then step; JAX dispatches the step asynchronously, so the next batch is
               built while it runs) and the same batches from a Grain `MapDataset` with --grain-threads
               prefetch threads. Loops alternate for --rounds rounds; each reports its fastest.
Figures on a shared machine move with its load: the load average is printed before and after preparation.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deberta_jax.data import batches, packing, store, text  # noqa: E402
from deberta_jax.data.tokenizer import SpecialIds, train_tokenizer  # noqa: E402

MB = 1e6
NOVEL_LETTERS = 7  # a fresh word: 7 random lowercase letters, practically never the same twice
ZIPF_VOCAB, ZIPF_EXPONENT, ZIPF_SHIFT = 50_000, 1.07, 2.7  # Zipf-Mandelbrot fit of English word frequencies
GENERATED_MB = 8  # text generated once, then repeated like a --source


def generated_text(seed: int) -> bytes:
    """Documents (blank-line separated) of sentences of Zipf-distributed pseudo-words."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 11, ZIPF_VOCAB)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, n)) for n in lengths], dtype=object)
    probs = 1.0 / (np.arange(ZIPF_VOCAB) + ZIPF_SHIFT) ** ZIPF_EXPONENT
    words = vocab[rng.choice(ZIPF_VOCAB, GENERATED_MB * 1_000_000 // 6, p=probs / probs.sum())]
    ends = np.cumsum(rng.integers(8, 40, len(words) // 8))
    sentences = [" ".join(words[a:b]) + " ." for a, b in itertools.pairwise(ends) if b <= len(words)]
    documents, i = [], 0
    while i < len(sentences):
        n = int(rng.integers(20, 120))
        documents.append("\n".join(sentences[i : i + n]))
        i += n
    return ("\n\n".join(documents) + "\n").encode()


def write_corpus(path: Path, base: bytes, size_bytes: int, novel_rate: float, seed: int) -> int:
    """Whole copies of `base` until `size_bytes`, each with `novel_rate` of its words (spaces) followed by a fresh
    word; returns the bytes written."""
    rng = np.random.default_rng(seed)
    buffer = np.frombuffer(base if base.endswith(b"\n") else base + b"\n", np.uint8)
    spaces = np.flatnonzero(buffer == ord(" "))
    written = 0
    with open(path, "wb") as f:
        while written < size_bytes:
            after = spaces[rng.random(len(spaces)) < novel_rate] + 1
            novel = rng.integers(ord("a"), ord("z") + 1, (len(after), NOVEL_LETTERS + 1), dtype=np.uint8)
            novel[:, -1] = ord(" ")
            block = np.insert(buffer, np.repeat(after, NOVEL_LETTERS + 1), novel.ravel())
            f.write(block.data)
            written += len(block)
    return written


class PeakMemory:
    """Peak resident memory of this process and all its descendants (VmRSS summed), sampled in a thread."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s, self.peak_mb, self._stop = interval_s, 0.0, threading.Event()

    def __enter__(self) -> PeakMemory:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, sum(map(_rss_mb, _process_tree(os.getpid()))))
            self._stop.wait(self.interval_s)


def _process_tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the thread or process ended meanwhile
            continue
        for child in children:
            pids += _process_tree(int(child))
    return pids


def _status_mb(pid: int | str, field: str) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return int(status.split(f"{field}:")[1].split()[0]) / 1024 if f"{field}:" in status else 0.0


def _rss_mb(pid: int) -> float:
    return _status_mb(pid, "VmRSS")


def own_memory() -> dict[str, float]:
    return {name: round(_status_mb("self", field), 1)
            for name, field in (("anon_mb", "RssAnon"), ("rss_mb", "VmRSS"), ("peak_rss_mb", "VmHWM"))}


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclasses.dataclass(frozen=True)
class Input:
    """What a training process needs to open a prepared store (picklable, for a fresh process)."""

    spec: str
    tokenizer_json: str
    seq_len: int
    cache_dir: str
    batch_size: int


def open_rows(inp: Input) -> tuple[packing.StreamRows, batches.Masker]:
    tokenizer = Tokenizer.from_str(inp.tokenizer_json)
    if not packing.cache_path(inp.spec, tokenizer, inp.cache_dir).is_dir():
        raise RuntimeError(f"{inp.spec} is not prepared in {inp.cache_dir}")
    rows = packing.load_or_pack(inp.spec, tokenizer, inp.seq_len, inp.cache_dir)
    from configs import deberta

    data = deberta.get_config("tiny").data
    masker = batches.Masker(SpecialIds.from_tokenizer(tokenizer), tokenizer.get_vocab_size(), data.mask_prob,
                            data.whole_word_masking)
    return rows, masker


def train_batch(rows: packing.StreamRows, masker: batches.Masker, batch_size: int, step: int) -> batches.Batch:
    return batches.train_batch(rows, masker, batch_size=batch_size, step=step, seed=0, process_index=0,
                               process_count=1)


def feed(inp: Input, num_batches: int) -> dict:
    """Run in a fresh process: open the store, build `num_batches` training batches; time and memory."""
    before = own_memory()
    rows, masker = open_rows(inp)
    times = []
    for step in range(num_batches):
        start = time.perf_counter()
        train_batch(rows, masker, inp.batch_size, step)
        times.append(time.perf_counter() - start)
    return {"before": before, "after": own_memory(), "rows": rows.num_rows,
            "host_ms": 1e3 * statistics.median(times)}


def time_steps(inp: Input, num_steps: int, rounds: int, grain_threads: int, grain_prefetch: int) -> dict:
    """Run in a fresh process: the tiny train step alone, train.py's loop, and the loop fed by Grain."""
    try:
        import grain
    except ImportError:
        sys.exit("benchmarks/data_pipeline.py compares train.py's loop with one fed by Grain, which the project does "
                 "not need otherwise: pip install grain (requirements-test.txt has it)")
    import jax

    from configs import deberta
    from deberta_jax.train import config_checks, optim, steps

    rows, masker = open_rows(inp)
    vocab_size = Tokenizer.from_str(inp.tokenizer_json).get_vocab_size()
    config = deberta.get_config("tiny")
    config.data.seq_len, config.data.train_files = inp.seq_len, inp.spec
    config.train.batch_size = inp.batch_size
    model_config = dataclasses.replace(config_checks.validate(config, num_devices=jax.device_count()),
                                       vocab_size=vocab_size)
    tc = config.train
    schedule = optim.learning_rate_schedule(tc.learning_rate, tc.warmup_steps, tc.num_steps, tc.schedule)
    optimizer = optim.make_optimizer(tc, schedule, model_config)
    step_fn = jax.jit(steps.make_train_step(steps.model_graphdef(model_config), optimizer, schedule, seed=0,
                                            grad_accum_steps=tc.grad_accum_steps, mask_prob=config.data.mask_prob),
                      donate_argnums=0)
    state = [jax.jit(steps.make_init_fn(model_config, optimizer, 0))()]
    fixed = jax.device_put(train_batch(rows, masker, inp.batch_size, 0))

    def run(batch_source) -> float:
        start = time.perf_counter()
        for batch in batch_source:
            state[0], metrics = step_fn(state[0], batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / num_steps

    def grain_batches():
        dataset = grain.MapDataset.range(num_steps).map(lambda step: train_batch(rows, masker, inp.batch_size, step))
        return dataset.to_iter_dataset(grain.ReadOptions(num_threads=grain_threads,
                                                         prefetch_buffer_size=grain_prefetch))

    loops = {"step_s": lambda: (fixed for _ in range(num_steps)),
             "loop_s": lambda: (train_batch(rows, masker, inp.batch_size, s) for s in range(num_steps)),
             "grain_loop_s": grain_batches}
    run(loops["step_s"]())  # compile
    best = {name: float("inf") for name in loops}
    for _ in range(rounds):
        for name, make in loops.items():
            best[name] = min(best[name], run(make()))
    return best


def in_fresh_process(fn, *args):
    """`fn(*args)` in a new interpreter, so that its memory is its own (nothing inherited from this one)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def whole_tokenizer(spec: str, vocab_size: int, stream: bool) -> dict:
    """Tokenizer training on all of `spec`, from a `DocumentStream` (train.py's way) or from a list."""
    start = time.perf_counter()
    documents = text.DocumentStream(spec) if stream else text.load_documents(spec)
    vocab = train_tokenizer(documents, vocab_size).to_str()
    return dict(seconds=time.perf_counter() - start, peak_mb=own_memory()["peak_rss_mb"], vocab=vocab)


def report_whole_tokenizer(path: Path, vocab_size: int) -> None:
    results = {how: in_fresh_process(whole_tokenizer, str(path), vocab_size, how == "stream")
               for how in ("stream", "list")}
    print(f"tokenizer on the whole {path.stat().st_size / MB:,.1f} MB corpus: " + "; ".join(
        f"from a {'DocumentStream' if how == 'stream' else 'list'} {r['seconds']:.1f} s, peak resident memory "
        f"{r['peak_mb']:.0f} MB" for how, r in results.items())
        + f"; same vocabulary: {results['stream']['vocab'] == results['list']['vocab']}", flush=True)


def prepare(name: str, path: Path, tokenizer: Tokenizer, args, cache_dir: Path) -> Input:
    size_mb = path.stat().st_size / MB
    load = os.getloadavg()[0]
    cpu = cpu_seconds()
    start = time.perf_counter()
    with PeakMemory() as memory:
        rows = packing.load_or_pack(str(path), tokenizer, args.seq_len, cache_dir, workers=args.workers)
    wall = time.perf_counter() - start
    cpu = cpu_seconds() - cpu
    tokens = len(rows.tokens)
    stored = packing.cache_path(str(path), tokenizer, cache_dir) / store.TOKENS_FILE
    print(f"prepare ({name}): {size_mb:,.1f} MB in {wall:.1f} s = {size_mb / wall:.1f} MB/s; {tokens:,} tokens "
          f"({tokens / wall / 1e6:.2f} M/s) into a {stored.stat().st_size / MB:,.0f} MB {rows.tokens.dtype} store; "
          f"CPU {cpu:.0f} s ({cpu / wall:.2f} cores, {1e3 * cpu / size_mb:.0f} ms/MB); peak resident memory "
          f"{memory.peak_mb / 1e3:.2f} GB (process tree, workers: {args.workers or os.cpu_count()}); "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    return Input(str(path), tokenizer.to_str(), args.seq_len, str(cache_dir), args.batch)


def report_feed(name: str, inp: Input, args) -> dict:
    result = in_fresh_process(feed, inp, args.batches)
    before, after = result["before"], result["after"]
    print(f"train input ({name}): {result['rows']:,} rows; {args.batch} x {args.seq_len} batches: host "
          f"{result['host_ms']:.2f} ms/batch (median of {args.batches}); resident memory of the process, own "
          f"(RssAnon) {before['anon_mb']:.0f} -> {after['anon_mb']:.0f} MB, with the memory map's file pages (VmRSS) "
          f"{before['rss_mb']:.0f} -> {after['rss_mb']:.0f} MB, peak {after['peak_rss_mb']:.0f} MB", flush=True)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=None, help="text file to repeat (default: generated Zipfian text)")
    parser.add_argument("--size-mb", type=float, default=1024, help="corpus size in MB (whole copies: a little more)")
    parser.add_argument("--small-mb", type=float, default=64, help="the second, small corpus (memory comparison)")
    parser.add_argument("--novel-rate", type=float, default=0.01, help="share of words followed by a fresh word")
    parser.add_argument("--vocab", type=int, default=8192, help="tokenizer vocabulary (tiny preset: 8192)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: one per CPU)")
    parser.add_argument("--batches", type=int, default=200, help="training batches built per corpus")
    parser.add_argument("--steps", type=int, default=10, help="train steps per loop; 0 skips the step phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--grain-threads", type=int, default=2)
    parser.add_argument("--grain-prefetch", type=int, default=4)
    parser.add_argument("--workdir", default=None, help="for the corpora and stores (default: a temporary "
                        "directory, deleted at the end)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--whole-tokenizer", action="store_true", help="also train a tokenizer on the whole small "
                        "corpus, streamed and from a list (minutes per 50 MB)")
    args = parser.parse_args(argv)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="data_pipeline-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        base = Path(args.source).read_bytes() if args.source else generated_text(args.seed)
        corpora = {name: workdir / f"{name}.txt" for name in ("full", "small")}
        written = {name: write_corpus(corpora[name], base, int(size_mb * MB), args.novel_rate, args.seed) / MB
                   for name, size_mb in (("full", args.size_mb), ("small", args.small_mb))}
        print(f"corpus: {written['full']:,.1f} MB and {written['small']:,.1f} MB from "
              f"{args.source or 'generated Zipfian text'} ({len(base) / MB:.1f} MB a copy), {args.novel_rate:.1%} of "
              f"words followed by a fresh one; written in {time.perf_counter() - start:.1f} s", flush=True)
        start = time.perf_counter()
        tokenizer = train_tokenizer(text.split_documents(base.decode("utf-8-sig").split("\n")), args.vocab)
        print(f"tokenizer: {tokenizer.get_vocab_size():,} WordPiece tokens trained on one copy in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        if args.whole_tokenizer:
            report_whole_tokenizer(corpora["small"], args.vocab)
        inputs = {name: prepare(name, path, tokenizer, args, workdir / "cache") for name, path in corpora.items()}
        fed = {name: report_feed(name, inp, args) for name, inp in inputs.items()}
        grown = fed["full"]["after"]["anon_mb"] - fed["small"]["after"]["anon_mb"]
        print(f"train input: the {args.size_mb / args.small_mb:.0f}x larger corpus holds {grown:+.0f} MB more of "
              f"the process's own memory", flush=True)
        if args.steps:
            best = in_fresh_process(time_steps, inputs["full"], args.steps, args.rounds, args.grain_threads,
                                    args.grain_prefetch)
            host_s = fed["full"]["host_ms"] / 1e3
            print(f"step (deberta tiny, {args.batch} x {args.seq_len}): {1e3 * best['step_s']:.0f} ms/step on a fixed "
                  f"batch; host {1e3 * host_s:.2f} ms/batch = {host_s / best['step_s']:.1%} of a step; loops of "
                  f"{args.steps} steps: train.py's {1e3 * best['loop_s']:.0f} ms/step, Grain ({args.grain_threads} "
                  f"threads, prefetch {args.grain_prefetch}) {1e3 * best['grain_loop_s']:.0f} ms/step", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
