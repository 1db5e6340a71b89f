"""Images and audio clips from the URLs a client sends: `data:` URLs, `file://` under one allowed folder, http(s)
from allowed hosts.

Everything here is blocking (file reads, downloads, decoding): the server calls it on a worker thread. Each
limit in `MediaPolicy` is checked before the work it bounds: a download stops past `max_bytes` (`max_audio_bytes`
for a clip), a picture larger than `max_pixels` is refused from its header, before its pixels are decoded, a clip
longer than `max_audio_seconds` likewise (llmplug.multimodal.audio decodes clips). Every refusal is an
InvalidRequestError whose message names the part (`param`) and what was wrong; nothing here is fatal to the
server.

Differences from vLLM: http(s) URLs are refused unless `--allowed-media-domains` lists the host (vLLM fetches
from any host by default), and only the common raster formats are decoded (Pillow's EPS reader runs
Ghostscript, and a client must not choose that).
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmplug.core.errors import ConfigError, InvalidRequestError
from llmplug.multimodal.audio import DEFAULT_MAX_AUDIO_BYTES, DEFAULT_MAX_AUDIO_SECONDS

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

DEFAULT_FETCH_TIMEOUT = 5.0  # seconds; vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 50_000_000
MAX_REDIRECTS = 5
# The formats Pillow may decode (Image.open's `formats`): the ones clients send, none that runs a program.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where images and audio clips may come from and how large they may be (the server's media flags)."""

    allowed_local_media_path: Path | None = None  # file:// URLs only under this folder; None: file:// refused
    allowed_media_domains: frozenset[str] = frozenset()  # hosts http(s) URLs may name; empty: http(s) refused
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT  # seconds for a whole download, redirects included
    max_bytes: int = DEFAULT_MAX_BYTES  # encoded size of one image (download, file or data URL)
    max_pixels: int = DEFAULT_MAX_PIXELS  # width * height of one image
    max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES  # encoded size of one audio clip
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS  # duration of one audio clip, read from its header

    @classmethod
    def of(cls, allowed_local_media_path: str | None = None, allowed_media_domains: str | None = None,
           **limits: float) -> "MediaPolicy":
        """A policy from the flags' text: a folder (resolved now) and comma-separated host names."""
        folder = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        if folder is not None and not folder.is_dir():
            raise ConfigError(f"--allowed-local-media-path {allowed_local_media_path}: no such folder")
        domains = frozenset(d.strip().lower() for d in (allowed_media_domains or "").split(",") if d.strip())
        return cls(folder, domains, **limits)


@dataclass(frozen=True, slots=True)
class _Kind:
    """What a URL must hold: its media type's top level and the byte cap of one item, with the flag that sets it."""

    name: str  # "image", "audio": the data URL's media type is <name>/...
    max_bytes: int
    flag: str


def load_image_url(url: str, policy: MediaPolicy, param: str = "image_url") -> "Image.Image":
    """The RGB image `url` holds or names; InvalidRequestError naming `param` when it may not be read or is
    not a usable image."""
    data = _url_bytes(url, policy, _Kind("image", policy.max_bytes, "--max-media-bytes"), param)
    return decode_image(data, policy, param)


def load_audio_url(url: str, policy: MediaPolicy, sampling_rate: int | None,
                   param: str = "audio_url") -> "np.ndarray":
    """The mono float32 samples at `sampling_rate` of the clip `url` holds or names; InvalidRequestError naming
    `param` when it may not be read or is not usable audio."""
    data = _url_bytes(url, policy, _audio_kind(policy), param)
    return decode_audio_bytes(data, policy, sampling_rate, param)


def load_input_audio(data: str, policy: MediaPolicy, sampling_rate: int | None,
                     param: str = "input_audio") -> "np.ndarray":
    """The clip of OpenAI's `input_audio` part (`data`: the base64 text of an encoded file), decoded as
    `load_audio_url` does."""
    return decode_audio_bytes(_base64_bytes(data, _audio_kind(policy), param, "input_audio.data"), policy,
                              sampling_rate, param)


def _audio_kind(policy: MediaPolicy) -> _Kind:
    """The byte cap of one audio clip."""
    return _Kind("audio", policy.max_audio_bytes, "--max-audio-clip-filesize-mb")


def decode_audio_bytes(data: bytes, policy: MediaPolicy, sampling_rate: int | None,
                       param: str = "input_audio") -> "np.ndarray":
    """An encoded clip (a base64 `input_audio` part's bytes, a file's) under the policy's caps, decoded."""
    from llmplug.multimodal.audio import decode_audio

    if len(data) > policy.max_audio_bytes:
        raise _too_large(param, _audio_kind(policy))
    return decode_audio(data, sampling_rate, policy.max_audio_seconds, param)


def _url_bytes(url: str, policy: MediaPolicy, kind: _Kind, param: str) -> bytes:
    """The bytes a data, file or http(s) URL holds or names, at most `kind.max_bytes`."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(url, kind, param)
    if scheme == "file":
        return _file_bytes(url, policy, kind, param)
    if scheme in ("http", "https"):
        return _http_bytes(url, policy, kind, param)
    raise InvalidRequestError(f"{param}: the URL must be a data:{kind.name}/...;base64 URL, a file:// URL or an "
                              f"http(s) URL; got {_shown(url)}", param=param)


def decode_image(data: bytes, policy: MediaPolicy, param: str = "image_url") -> "Image.Image":
    """The image in `data` (a PNG, JPEG, ... file), checked and fully decoded, in RGB."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        # Pillow's own bomb check is a process-wide setting; ours is the policy's, from the header
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except UnidentifiedImageError:
            raise InvalidRequestError(f"{param}: the data is not an image in a supported format "
                                      f"({', '.join(IMAGE_FORMATS)})", param=param) from None
        except Image.DecompressionBombError:
            raise _too_many_pixels(param, policy, "") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:  # a broken header, as Pillow reports it
            raise _corrupt(param, "", exc) from None
        if image.width * image.height > policy.max_pixels:
            raise _too_many_pixels(param, policy, f"{image.width}x{image.height} = {image.width * image.height} "
                                                  "pixels, ")
        try:
            image.load()
        except Image.DecompressionBombError:
            raise _too_many_pixels(param, policy, "") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated or corrupt pixel data
            raise _corrupt(param, image.format or "", exc) from None
    return to_rgb(image)


def to_rgb(image: "Image.Image") -> "Image.Image":
    """`image` in RGB; transparent pixels become white, as vLLM converts them."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("LA", "PA") or image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode != "RGBA":
        return image.convert("RGB")
    background = Image.new("RGB", image.size, (255, 255, 255))
    background.paste(image, mask=image.getchannel("A"))
    return background


def _too_many_pixels(param: str, policy: MediaPolicy, size: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: the image has too many pixels ({size}more than the limit of "
                               f"{policy.max_pixels}, --max-image-pixels)", param=param)


def _corrupt(param: str, image_format: str, exc: BaseException) -> InvalidRequestError:
    kind = f"{image_format} " if image_format else ""
    return InvalidRequestError(f"{param}: the image could not be decoded (truncated or corrupt {kind}data: {exc})",
                               param=param)


def _data_url_bytes(url: str, kind: _Kind, param: str) -> bytes:
    """The bytes of a `data:<kind>/<type>;base64,<data>` URL."""
    header, sep, payload = url.partition(",")
    media_type = header[len("data:"):].split(";")[0].strip().lower()
    if not sep or ";base64" not in header.lower() or not media_type.startswith(f"{kind.name}/"):
        raise InvalidRequestError(f"{param}: a data URL must be data:{kind.name}/<type>;base64,<data>; got "
                                  f"{_shown(header + sep)}", param=param)
    return _base64_bytes(payload, kind, param, "the data URL")


def _base64_bytes(payload: str, kind: _Kind, param: str, what: str = "the data") -> bytes:
    """The bytes of base64 text, its size checked against `kind`'s cap before decoding."""
    if len(payload) > kind.max_bytes * 4 // 3 + 4:
        raise _too_large(param, kind)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"{param}: {what} is not valid base64 ({exc})", param=param) from None


def _file_bytes(url: str, policy: MediaPolicy, kind: _Kind, param: str) -> bytes:
    """The bytes of a file:// URL inside `policy.allowed_local_media_path` (symlinks and '..' resolved first)."""
    folder = policy.allowed_local_media_path
    if folder is None:
        raise InvalidRequestError(f"{param}: file:// URLs are off on this server (start it with "
                                  "--allowed-local-media-path DIR to serve media from DIR)", param=param)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"{param}: a file:// URL names a file on this machine; got host "
                                  f"{_shown(parsed.netloc)}", param=param)
    path = Path(urllib.parse.unquote(parsed.path))
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise InvalidRequestError(f"{param}: no such file under the allowed media path: {_shown(str(path))}",
                                  param=param) from None
    if not resolved.is_relative_to(folder.resolve()):
        raise InvalidRequestError(f"{param}: {_shown(str(path))} is outside the allowed media path "
                                  "(--allowed-local-media-path)", param=param)
    if not resolved.is_file():
        raise InvalidRequestError(f"{param}: {_shown(str(path))} is not a file", param=param)
    with resolved.open("rb") as file:
        data = file.read(kind.max_bytes + 1)
    if len(data) > kind.max_bytes:
        raise _too_large(param, kind)
    return data


def _http_bytes(url: str, policy: MediaPolicy, kind: _Kind, param: str) -> bytes:
    """The body of an http(s) URL on an allowed host, at most `kind.max_bytes`, within `policy.fetch_timeout`;
    redirects are followed only to allowed hosts."""
    import httpx2 as httpx  # the HTTP client the openai package (llmplug[serve]) is built on

    deadline = time.monotonic() + policy.fetch_timeout
    # trust_env off: no proxy from the environment between the allow-list and the host it allows
    with httpx.Client(timeout=policy.fetch_timeout, follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_host(url, policy, param)
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = str(response.url.join(response.headers["location"]))
                        continue
                    if response.status_code != 200:
                        raise InvalidRequestError(f"{param}: fetching {_shown(url)} answered HTTP "
                                                  f"{response.status_code}", param=param)
                    return _read_capped(response, deadline, policy, kind, param, url)
            except httpx.TimeoutException:
                raise _timed_out(param, url, policy) from None
            except httpx.HTTPError as exc:
                raise InvalidRequestError(f"{param}: fetching {_shown(url)} failed: {exc}", param=param) from None
    raise InvalidRequestError(f"{param}: {_shown(url)} redirects more than {MAX_REDIRECTS} times", param=param)


def _check_host(url: str, policy: MediaPolicy, param: str) -> None:
    parsed = urllib.parse.urlparse(url)
    host = (parsed.hostname or "").lower()
    if parsed.scheme not in ("http", "https"):
        raise InvalidRequestError(f"{param}: a redirect to {_shown(url)} leaves http(s)", param=param)
    if host not in policy.allowed_media_domains:
        allowed = ", ".join(sorted(policy.allowed_media_domains)) or "none: http(s) image URLs are off"
        raise InvalidRequestError(f"{param}: the host {_shown(host)} is not an allowed media domain "
                                  f"(--allowed-media-domains: {allowed})", param=param)


def _read_capped(response: object, deadline: float, policy: MediaPolicy, kind: _Kind, param: str,
                 url: str) -> bytes:
    """The response body, stopping as soon as it passes the byte cap or the deadline (a slow drip)."""
    declared = response.headers.get("content-length")  # type: ignore[attr-defined]
    if declared is not None and declared.isdigit() and int(declared) > kind.max_bytes:
        raise _too_large(param, kind)
    body = bytearray()
    for chunk in response.iter_bytes(_CHUNK):  # type: ignore[attr-defined]
        body += chunk
        if len(body) > kind.max_bytes:
            raise _too_large(param, kind)
        if time.monotonic() > deadline:
            raise _timed_out(param, url, policy)
    return bytes(body)


def _too_large(param: str, kind: _Kind) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: the {kind.name} is larger than the limit of {kind.max_bytes} bytes "
                               f"({kind.flag})", param=param)


def _timed_out(param: str, url: str, policy: MediaPolicy) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: fetching {_shown(url)} took longer than {policy.fetch_timeout} s "
                               "(--media-fetch-timeout)", param=param)


def _shown(text: str, limit: int = 100) -> str:
    """Client text in a message: quoted, escaped, cut short (a data URL can be megabytes)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
