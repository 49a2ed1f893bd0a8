"""Images in: URLs and base64 from the request turned into RGB pixels and a content hash, under a MediaPolicy.

- policy.py: MediaPolicy and its flags (--allowed-media-domains, --allowed-local-media-path, limits)
- loader.py: load_image (data:, http(s):, file: URLs) and load_base64_image (Anthropic base64 blocks)
- fetch.py: http(s) fetching with limits and the SSRF check inside the connector (addresses.py says who is public)
- inline.py: data: URLs, base64, file: URLs
- decode.py: bytes -> LoadedImage, format and pixel limits checked from the header before decoding
Every refusal is an APIError 400 naming the problem and the request field.
"""

from steploop.gateway.media.decode import LoadedImage
from steploop.gateway.media.loader import load_base64_image, load_image
from steploop.gateway.media.policy import MediaPolicy

__all__ = ["LoadedImage", "MediaPolicy", "load_base64_image", "load_image"]
