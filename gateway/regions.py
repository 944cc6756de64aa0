"""The region catalog (infra/regions.yaml) and great-circle distances between regions."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.model_specs import parse_models

# The catalog ships inside the package (package data, pyproject.toml), so an installed gateway
# has it; infra/deploy.py renders the regions' manifests from this same file. A package installed
# by pip is on disk, so this is a real path (the CLI passes it on as the --regions default).
DEFAULT_CATALOG = Path(__file__).with_name("regions.yaml")
EARTH_RADIUS_KM = 6371.0
# A region's name is a DNS-1123 label short enough that its namespace, edgeinfer-NAME, is one too
# (at most 63 characters): lower-case letters, digits and '-', starting and ending with a letter
# or digit. `US_East` rendered a namespace Kubernetes refuses, as did a name of 54 or more.
NAMESPACE_PREFIX = "edgeinfer-"
MAX_NAME = 63 - len(NAMESPACE_PREFIX)  # 53
_NAME = re.compile(rf"^[a-z0-9](?:[a-z0-9-]{{0,{MAX_NAME - 2}}}[a-z0-9])?$")
# a region entry's fields (a misspelt one is refused)
FIELDS = ("name", "latitude", "longitude", "settings")
# the catalog's own fields: its regions, and the Redis they all share (infra/deploy.py reads it;
# a gateway takes its Redis from --redis or $EDGEINFER_REDIS). A misspelt one is refused
TOP_FIELDS = ("regions", "redis_url")


class CatalogError(ValueError):
    """The catalog file is missing or malformed; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Region:
    name: str  # region id, as `--region` takes it
    latitude: float  # degrees, [-90, 90]
    longitude: float  # degrees, [-180, 180]
    settings: dict[str, Any] = field(default_factory=dict, hash=False)  # per-region deploy values


def great_circle_km(a: Region, b: Region) -> float:
    """Haversine distance between two regions' points of presence."""
    lat1, lon1, lat2, lon2 = map(math.radians, (a.latitude, a.longitude, b.latitude, b.longitude))
    h = (
        math.sin((lat2 - lat1) / 2) ** 2
        + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    )
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


class RegionCatalog:
    def __init__(self, regions: list[Region], redis_url: str | None = None) -> None:
        self.regions = {r.name: r for r in regions}
        # the Redis every region's deploy points its pods at (the catalog's `redis_url`); None:
        # each region's own settings.redis_url, or a Redis of its own (see infra/regions.yaml)
        self.redis_url = redis_url

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CATALOG) -> RegionCatalog:
        import yaml  # here: every `edgeinfer` command names the catalog's default path

        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as e:
            raise CatalogError(f"{path}: cannot read the region catalog: {e}") from e
        except UnicodeDecodeError as e:  # (a ValueError: it named no file)
            raise CatalogError(f"{path}: cannot read the region catalog: not UTF-8: {e}") from e
        except yaml.YAMLError as e:
            raise CatalogError(f"{path}: not valid YAML: {e}") from e
        entries = raw.get("regions") if isinstance(raw, dict) else None
        if not isinstance(entries, list) or not entries:
            raise CatalogError(f"{path}: needs a non-empty `regions:` list")
        assert isinstance(raw, dict)
        unknown_top = [str(k) for k in raw if k not in TOP_FIELDS]
        if unknown_top:
            raise CatalogError(f"{path}: unknown field {unknown_top[0]!r} (a catalog has "
                               f"{', '.join(TOP_FIELDS)})")  # fmt: skip
        redis_url = raw.get("redis_url")
        if redis_url is not None and (not isinstance(redis_url, str) or not redis_url):
            raise CatalogError(f"{path}: redis_url must be a Redis URL, got {redis_url!r}")
        regions = []
        first: dict[str, int] = {}  # name -> the index of the entry that first gave it
        for i, entry in enumerate(entries):
            where = f"{path}: regions[{i}]"
            if not isinstance(entry, dict):
                raise CatalogError(f"{where}: must be a mapping")
            name = entry.get("name")
            if name is None:
                raise CatalogError(f"{where}: name is missing")
            if not isinstance(name, str) or not _NAME.match(name):
                raise CatalogError(
                    f"{where}: name must be at most {MAX_NAME} lower-case letters, digits and "
                    "'-', starting and ending with a letter or digit (a DNS label: the region's "
                    f"namespace is {NAMESPACE_PREFIX}NAME), got {name!r}"
                )
            unknown = [str(k) for k in entry if k not in FIELDS]
            if unknown:  # (`setting:` for `settings:` left the region's settings unread)
                raise CatalogError(f"{where} ({name}): unknown field {unknown[0]!r} (a region has "
                                   f"{', '.join(FIELDS)})")  # fmt: skip
            lat, lon = entry.get("latitude"), entry.get("longitude")
            for key, value, limit in (("latitude", lat, 90), ("longitude", lon, 180)):
                if value is None:
                    raise CatalogError(f"{where} ({name}): {key} is missing (degrees, in "
                                       f"[-{limit}, {limit}])")  # fmt: skip
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CatalogError(f"{where} ({name}): {key} must be a number")
                if not -limit <= value <= limit:
                    raise CatalogError(f"{where} ({name}): {key} must be in [-{limit}, {limit}]")
            settings = entry.get("settings") or {}
            if not isinstance(settings, dict):
                raise CatalogError(f"{where} ({name}): settings must be a mapping")
            models = settings.get("models")
            if isinstance(models, list) and all(isinstance(m, str) for m in models):
                try:  # (the gateways read the served names: one model twice, or `=DIR`)
                    parse_models(",".join(models), resolve=str)
                except ValueError as e:
                    raise CatalogError(f"{where} ({name}): settings.models: {e}") from e
            if name in first:
                raise CatalogError(f"{where} ({name}): duplicate region name: "
                                   f"regions[{first[name]}] is {name} too")  # fmt: skip
            first[name] = i
            regions.append(Region(name, float(lat), float(lon), settings))  # type: ignore[arg-type]
        return cls(regions, redis_url)

    def __contains__(self, name: object) -> bool:
        return name in self.regions

    def distance_km(self, a: str, b: str) -> float:
        """Distance between two regions; unknown regions are infinitely far."""
        if a == b:
            return 0.0
        if a not in self.regions or b not in self.regions:
            return math.inf
        return great_circle_km(self.regions[a], self.regions[b])

    def nearest_first(self, origin: str, names: set[str] | list[str]) -> list[str]:
        """`names` ordered by distance from `origin` (itself first, unknown ones last, by name).

        Itself first also when another region is as near: two regions of the catalog at one
        point of presence (the same coordinates) are 0 km apart, and by name alone the other
        one's workers were preferred to the gateway's own region's."""
        return sorted(set(names), key=lambda n: (n != origin, self.distance_km(origin, n), n))
