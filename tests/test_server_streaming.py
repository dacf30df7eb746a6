"""The stream's stop-string hold-back, as a pure function of the cumulative texts."""

from hypothesis import given
from hypothesis import strategies as st

from serving.streaming import TextDeltas, held_back


def test_held_back_is_the_longest_suffix_that_starts_a_stop_string():
    assert held_back("the pt", ["ptre"]) == 2
    assert held_back("the p", ["ptre", "xp"]) == 1
    assert held_back("the ptr", ["ptre", "r"]) == 3
    assert held_back("the end", ["ptre"]) == 0
    assert held_back("", ["ab"]) == 0


@given(text=st.text(alphabet="abc ", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                    min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_deltas_join_to_the_final_text_and_never_send_a_stop_string(text, stops, cuts):
    """The engine's cumulative texts grow until a stop string appears, then the final text is cut before it: the
    deltas join to exactly the final text, whatever the growth steps."""
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    final = text if first is None else text[:first]
    seen = text if first is None else text[:first + next(len(s) for s in stops if text.find(s) == first)]
    steps = sorted({min(c, len(seen)) for c in cuts}) + [len(seen)]
    deltas = TextDeltas(stops)
    sent = "".join(deltas.delta(seen[:n], False) for n in steps[:-1] if not any(s in seen[:n] for s in stops))
    sent += deltas.delta(final, True)
    assert sent == final
