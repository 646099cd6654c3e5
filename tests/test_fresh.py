"""reward/fresh_by_version: rewards of received samples per generating version (roles.fresh)."""
import math

from buffer_helpers import make_batch

from hpc_tba.roles.fresh import FreshRewards


def _batch(version: int, rewards: list[float]):
    return make_batch(version, [[1, 2, i] for i in range(len(rewards))], rewards, version=version)


def _sum_over_ranks(dicts):
    """What reduce_metrics(sum) does with these keys: NaN is 'no value on this rank'."""
    out = {}
    for k in dicts[0]:
        vals = [d[k] for d in dicts if not math.isnan(d[k])]
        if vals:
            out[k] = sum(vals)
    return out


def test_versions_close_two_syncs_late_with_the_same_keys_on_every_rank():
    a, b = FreshRewards(), FreshRewards()
    a.add(_batch(0, [0.0, 1.0]))
    b.add(_batch(0, [1.0, 1.0]))
    a.add(_batch(2, [1.0, 1.0, 1.0, 0.0]))  # rank b got nothing of version 2
    assert a.closing(2, 2) == {} and b.closing(2, 2) == {}  # version 0 is one sync old: still open
    ka, kb = a.closing(4, 2), b.closing(4, 2)
    assert set(ka) == set(kb) == {"fresh/0/sum", "fresh/0/n"}
    by_version, rest = FreshRewards.split({**_sum_over_ranks([ka, kb]), "loss/total": 1.0})
    assert by_version == {0: {"reward/fresh_by_version": 0.75, "samples/fresh_by_version": 4.0}}
    assert rest == {"loss/total": 1.0}
    a.add(_batch(0, [1.0]))  # after version 0 was logged
    assert a.late == 1 and 0 not in a.acc
    ka, kb = a.closing(6, 2, final=True), b.closing(6, 2, final=True)
    assert set(ka) == set(kb) == {f"fresh/{v}/{x}" for v in range(1, 7) for x in ("sum", "n")}
    assert math.isnan(kb["fresh/2/n"])
    by_version, _ = FreshRewards.split(_sum_over_ranks([ka, kb]))
    assert by_version == {2: {"reward/fresh_by_version": 0.75, "samples/fresh_by_version": 4.0}}
    assert a.closing(6, 2, final=True) == {}  # nothing closes twice
