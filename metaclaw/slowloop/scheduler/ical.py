"""The calendar signal: busy while an event of an iCalendar feed (file or URL) is happening."""

from __future__ import annotations

import os
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable

from metaclaw.redact import url_host
from metaclaw.slowloop.scheduler.signals import (Clock, Signal, SignalReading, _seconds, _short,
                                                 _zone, now_ts)

#: Largest calendar accepted, in bytes: a feed that never ends must not fill the memory.
MAX_CALENDAR_BYTES = 64 * 1024 * 1024
#: Occurrences of one recurring event read per check, from its first one: a rule such as
#: FREQ=SECONDLY would otherwise take minutes to reach today; such an event is skipped.
MAX_OCCURRENCES = 100_000


@dataclass
class _Series:
    """One VEVENT reduced to what the busy test needs; times are wall-clock in ``zone``."""

    summary: str
    zone: Any
    all_day: bool
    start: datetime                  # naive wall-clock start of the first occurrence
    duration: timedelta
    rules: Any = None                # dateutil rruleset, or None for a one-off event
    excluded: set = field(default_factory=set)
    ended: bool = False              # every occurrence has been read ...
    last: datetime | None = None     # ... and this is the last one (None: there is none)
    too_many: bool = False           # more than MAX_OCCURRENCES before the checked time

    def starts(self, low: datetime, high: datetime) -> list[datetime]:
        """Starts of the occurrences in [low, high] (naive wall-clock in ``zone``)."""
        if self.rules is None:
            return [self.start] if low <= self.start <= high else []
        if self.too_many or (self.ended and (self.last is None or self.last < low)):
            return []
        found, last = [], None
        for count, start in enumerate(self.rules):  # in order, from the first occurrence
            if start > high:
                return found
            if count >= MAX_OCCURRENCES:
                self.too_many = True
                return []
            if start >= low:
                found.append(start)
            last = start
        # a rule that can never match (FREQ=DAILY;BYMONTHDAY=31;BYMONTH=2) ends only after
        # dateutil has walked to the year 9999: remember that, rather than walk again each check
        self.ended, self.last = True, last
        return found


def _wall(value: date | datetime, zone: Any) -> datetime:
    """A DTSTART/EXDATE/RECURRENCE-ID value as a naive wall-clock datetime in ``zone``."""
    if not isinstance(value, datetime):
        return datetime(value.year, value.month, value.day)
    if value.tzinfo is None:
        return value
    return value.astimezone(zone).replace(tzinfo=None)


def parse_calendar(data: bytes | str, tz: Any) -> list[_Series]:
    """Parse iCalendar text into busy series. ``tz``: zone for all-day and floating times.

    Skipped: cancelled events, events marked free (``TRANSP:TRANSPARENT``), malformed events.
    Raises ValueError if the text is not an iCalendar document.
    """
    import icalendar
    from dateutil.rrule import rruleset, rrulestr

    try:
        # a stream may hold several VCALENDAR objects (RFC 5545 section 3.4), e.g. exports
        # joined into one file
        calendars = icalendar.Calendar.from_ical(data, multiple=True)
    except Exception as exc:  # noqa: BLE001 - icalendar raises various types on bad input
        raise ValueError(f"not a valid iCalendar document ({_short(exc)})") from None
    if not calendars:
        raise ValueError("not a valid iCalendar document (no BEGIN:VCALENDAR ... END:VCALENDAR)")
    events = [event for calendar in calendars for event in calendar.walk("VEVENT")]
    overrides: dict[str, set] = {}
    series: list[_Series] = []
    masters: dict[str, _Series] = {}
    for event in events:
        try:
            if str(event.get("STATUS", "")).upper() == "CANCELLED" and "RECURRENCE-ID" not in event:
                continue
            start = event.start
            all_day = not isinstance(start, datetime)
            zone = tz if all_day or start.tzinfo is None else start.tzinfo
            uid = str(event.get("UID", ""))
            if "RECURRENCE-ID" in event:
                overrides.setdefault(uid, set()).add(event.decoded("RECURRENCE-ID"))
                if str(event.get("STATUS", "")).upper() == "CANCELLED":
                    continue
            if str(event.get("TRANSP", "OPAQUE")).upper() == "TRANSPARENT":
                continue
            duration = event.duration
            if not duration or duration <= timedelta(0):
                continue
            item = _Series(str(event.get("SUMMARY", "busy")), zone, all_day, _wall(start, zone),
                           duration)
            rrules, rdates = event.rrules, event.rdates
            if (rrules or rdates) and "RECURRENCE-ID" not in event:
                rules = rruleset(cache=True)
                for recur in rrules:
                    # dateutil loops forever on these instead of refusing them
                    if any(n < 1 for key in ("INTERVAL", "COUNT") for n in recur.get(key, ())):
                        raise ValueError("INTERVAL and COUNT must be positive")
                    until = recur.get("UNTIL")
                    text = icalendar.vRecur({k: v for k, v in recur.items() if k != "UNTIL"})
                    rule = rrulestr(text.to_ical().decode(), dtstart=item.start)
                    if until:
                        end = until[0]
                        if not isinstance(end, datetime):
                            end = datetime(end.year, end.month, end.day, 23, 59, 59)
                        rule = rule.replace(until=_wall(end, zone))
                    rules.rrule(rule)
                rules.rdate(item.start)
                for moment, _period_end in rdates:
                    rules.rdate(_wall(moment, zone))
                for moment in event.exdates:
                    rules.exdate(_wall(moment, zone))
                item.rules = rules
                masters[uid] = item
            series.append(item)
        except Exception:  # noqa: BLE001 - one malformed event must not hide the others
            continue
    for uid, moments in overrides.items():
        master = masters.get(uid)
        if master is not None:
            master.excluded.update(_wall(m, master.zone) for m in moments)
    return series


def busy_events(series: Iterable[_Series], when: datetime) -> list[tuple[str, datetime]]:
    """Events happening at the aware datetime ``when``: a list of (summary, end as aware UTC)."""
    moment = when.timestamp()
    found = []
    for item in series:
        wall_now = when.astimezone(item.zone).replace(tzinfo=None)
        for start in item.starts(wall_now - item.duration - timedelta(days=1),
                                 wall_now + timedelta(days=1)):
            if start in item.excluded:
                continue
            end_wall = start + item.duration
            begin = start.replace(tzinfo=item.zone).timestamp()
            end = end_wall.replace(tzinfo=item.zone).timestamp()
            if begin <= moment < end:
                found.append((item.summary, datetime.fromtimestamp(end, timezone.utc)))
    return found


class CalendarBusy(Signal):
    """Idle (window open) while an event of the calendar is happening: the user is in a meeting.

    ``source`` is a path to an ``.ics`` file or an ``http(s)://`` / ``webcal://`` URL (Google
    Calendar's "secret address in iCal format" works). The calendar is loaded on the first reading
    and re-fetched every ``refresh_s`` seconds; if a fetch fails the last good calendar stays in
    use and the failure is reported in the reading's detail and in :attr:`last_error`; while no
    calendar has loaded yet, loading is retried every minute at most. All-day and floating times
    are read in ``tz`` (None = machine zone).
    """

    def __init__(self, source: str | os.PathLike[str], refresh_s: float = 900.0, *,
                 tz: str | None = None, clock: Clock = time.time, timeout_s: float = 10.0,
                 name: str = "calendar"):
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError(f"the calendar source must be a path to an .ics file or an http(s) "
                             f"iCal URL, got {type(source).__name__} {source!r}")
        if not str(source).strip():
            raise ValueError("the calendar source is empty; give a path to an .ics file or an "
                             "http(s) iCal URL")
        self.source = str(source)
        self.refresh_s = _seconds(refresh_s, "the calendar refresh interval")
        self.tz = _zone(tz)
        self.timeout_s = _seconds(timeout_s, "the calendar fetch timeout")
        if not self.timeout_s:
            raise ValueError("the calendar fetch timeout must be more than 0 seconds")
        self.clock, self.name = clock, name
        self.series: list[_Series] | None = None
        self._data: bytes | None = None  # the text the series were parsed from
        self.loaded_at: float | None = None
        self.last_attempt: float | None = None
        self.last_error: str | None = None
        self.fetches = 0

    def _fetch(self) -> bytes:
        source = self.source
        if source.startswith("webcal://"):
            source = "https://" + source[len("webcal://"):]
        if source.startswith(("http://", "https://")):
            request = urllib.request.Request(source, headers={"User-Agent": "metaclaw"})
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = response.read(MAX_CALENDAR_BYTES + 1)
        else:
            with open(Path(source).expanduser(), "rb") as handle:
                data = handle.read(MAX_CALENDAR_BYTES + 1)
        if len(data) > MAX_CALENDAR_BYTES:
            raise ValueError(f"the calendar is larger than {MAX_CALENDAR_BYTES // 2**20} MiB")
        return data

    def refresh(self) -> bool:
        """Fetch and parse the calendar now; True on success (else the last good one is kept)."""
        self.last_attempt = now_ts(self.clock)
        self.fetches += 1
        try:
            data = self._fetch()
            # unchanged text keeps its parsed series, and with them what they learned about
            # their recurrence rules (see _Series.starts)
            series = self.series if data == self._data else parse_calendar(data, self.tz)
        except Exception as exc:  # noqa: BLE001 - reported, and the last good calendar is kept
            self.last_error = (f"could not load the calendar from {url_host(self.source)}: "
                               f"{_short(exc)}")
            return False
        self.series, self._data = series, data
        self.loaded_at, self.last_error = self.last_attempt, None
        return True

    def reading(self) -> SignalReading:
        now = now_ts(self.clock)
        every = self.refresh_s if self.series is not None else min(self.refresh_s, 60.0)
        # a clock set back (now before the last attempt) must not hold off refreshing
        if self.last_attempt is None or not 0 <= now - self.last_attempt < every:
            self.refresh()
        if self.series is None:
            return self._read(False, False, f"unavailable: {self.last_error}")
        events = busy_events(self.series, datetime.fromtimestamp(now, timezone.utc))
        if events:
            summary, end = max(events, key=lambda e: e[1])
            detail = f"busy: {summary} until {end.astimezone(self.tz):%Y-%m-%d %H:%M}"
        else:
            detail = f"free ({len(self.series)} events loaded)"
        skipped = sum(item.too_many for item in self.series)
        if skipped:
            detail += (f"; {skipped} recurring event(s) ignored: more than {MAX_OCCURRENCES} "
                       f"occurrences before now")
        if self.last_error:
            detail += f"; using the last good calendar, {self.last_error}"
        return self._read(True, bool(events), detail)
