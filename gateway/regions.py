"""The region catalog (infra/regions.yaml) and great-circle distances between regions."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The catalog ships inside the package (package data, pyproject.toml), so an installed gateway
# has it; infra/deploy.py renders the regions' manifests from this same file. A package installed
# by pip is on disk, so this is a real path (the CLI passes it on as the --regions default).
DEFAULT_CATALOG = Path(__file__).with_name("regions.yaml")
EARTH_RADIUS_KM = 6371.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
# a region entry's fields (a misspelt one is refused)
FIELDS = ("name", "latitude", "longitude", "settings")


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
    def __init__(self, regions: list[Region]) -> None:
        self.regions = {r.name: r for r in regions}

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
        regions = []
        for i, entry in enumerate(entries):
            where = f"{path}: regions[{i}]"
            if not isinstance(entry, dict):
                raise CatalogError(f"{where}: must be a mapping")
            name = entry.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise CatalogError(f"{where}: name must match {_NAME.pattern}, got {name!r}")
            unknown = [str(k) for k in entry if k not in FIELDS]
            if unknown:  # (`setting:` for `settings:` left the region's settings unread)
                raise CatalogError(f"{where} ({name}): unknown field {unknown[0]!r} (a region has "
                                   f"{', '.join(FIELDS)})")  # fmt: skip
            lat, lon = entry.get("latitude"), entry.get("longitude")
            for key, value, limit in (("latitude", lat, 90), ("longitude", lon, 180)):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CatalogError(f"{where} ({name}): {key} must be a number")
                if not -limit <= value <= limit:
                    raise CatalogError(f"{where} ({name}): {key} must be in [-{limit}, {limit}]")
            settings = entry.get("settings") or {}
            if not isinstance(settings, dict):
                raise CatalogError(f"{where} ({name}): settings must be a mapping")
            regions.append(Region(name, float(lat), float(lon), settings))  # type: ignore[arg-type]
        names = [r.name for r in regions]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise CatalogError(f"{path}: duplicate region names {dupes}")
        return cls(regions)

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
