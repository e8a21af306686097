"""Check trained heads in real vLLM: export them in every format vLLM serves, decode the same prompts greedily in vLLM
(plain, and with each export) and in selfspec's engine, and compare.

    bash scripts/make_vllm_venv.sh      # once: vLLM's CPU build in its own venv (.venv-vllm)
    python scripts/serve_check.py heads=outputs/medusa-smollm2/heads prompts=../shared/data/mt_bench/question.jsonl
    python scripts/serve_check.py heads=outputs/eagle3-smollm2/heads prompts=humaneval limit=4 k=2 max_new_tokens=64
    python scripts/serve_check.py heads=outputs/dflash-smollm2/heads prompts=humaneval limit=4   # k: its block less one

It prints, per format and prompt: that the export loaded; that vLLM's tokens equal vLLM's plain decoding and HF
``generate`` (a mismatch is printed and the exit status is 1); vLLM's acceptance counters per draft position beside
selfspec's for the same heads proposing the same chain (adaptive depth and the suffix drafter off); tokens/s in both
engines and the speedup the heads give inside vLLM. ``out`` gets the exports, vLLM's log, report.json and report.md.
How it works: decode/serving.py. Exit status 1 also when a format does not load or acceptance differs by more than
``tolerance``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from core.errors import reported_errors  # noqa: E402


def run_check(cfg) -> dict:
    import json

    from omegaconf import OmegaConf

    from decode.bench import load_prompts
    from decode.serving import CheckSettings, format_report, serve_check, vllm_python
    from core.config import to_plain
    from core.errors import SettingError

    for key, example in (("heads", "outputs/medusa-smollm2/heads"), ("prompts", "../shared/data/mt_bench/question.jsonl")):
        if OmegaConf.is_missing(cfg, key):
            raise SettingError(f"{key} is not set: give {key}=... (e.g. {key}={example}).")
    vllm_python(cfg.serving.vllm_venv)  # before loading anything: say at once when vLLM's venv is missing
    questions = load_prompts(to_plain(cfg.prompts), limit=cfg.get("limit"))
    out = Path(str(cfg.out))
    settings = CheckSettings.from_config(cfg)
    report = serve_check(str(cfg.heads), [q["turns"][0] for q in questions], formats=to_plain(cfg.formats),
                         settings=settings)
    text = format_report(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(text + "\n")
    print(text)
    return report


@hydra.main(config_path="../conf/decode", config_name="serve_check", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors():
        report = run_check(cfg)
    if not report["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
