"""What each worker of a run did when: the recorder every process writes with, and the reader of a run's files."""

from areal_agents.timeline.reader import RunTimeline, Span, read_timeline
from areal_agents.timeline.recorder import (
    DIR_ENV,
    EPISODE,
    NULL,
    NullTimeline,
    Timeline,
    close_timeline,
    in_episode,
    open_timeline,
    timeline,
    timeline_from_env,
)

__all__ = [
    "DIR_ENV",
    "EPISODE",
    "NULL",
    "NullTimeline",
    "RunTimeline",
    "Span",
    "Timeline",
    "close_timeline",
    "in_episode",
    "open_timeline",
    "read_timeline",
    "timeline",
    "timeline_from_env",
]
