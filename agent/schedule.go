package agent

import (
	"time"

	"github.com/tokenbroker/tokenbroker/agent/config"
)

// grant is the lifetime of one credential or certificate: when it was
// obtained and when it expires. The granted lifetime is the difference,
// measured from the moment the answer arrived, not from what was asked.
type grant struct {
	leaseID    string
	obtainedAt time.Time
	expiresAt  time.Time
}

func (g grant) lifetime() time.Duration { return g.expiresAt.Sub(g.obtainedAt) }

// schedule decides when to try again. It is pure apart from its Rand, so
// that tests drive it with a fixed clock and a fixed random source.
type schedule struct {
	// fraction of the granted lifetime after which to refresh.
	fraction float64
	// jitter is the largest part of a delay taken off at random, as a
	// fraction of the delay: refreshes of many agents and targets spread
	// out, and they only ever come earlier, never later.
	jitter                 float64
	minBackoff, maxBackoff time.Duration
	rand                   Rand
}

func newSchedule(r config.RefreshConfig, rnd Rand) schedule {
	return schedule{
		fraction:   r.Fraction,
		jitter:     r.Jitter,
		minBackoff: time.Duration(r.MinBackoff),
		maxBackoff: time.Duration(r.MaxBackoff),
		rand:       rnd,
	}
}

// refreshAt returns when to replace g: fraction × its lifetime after it
// was obtained, less a random part in [0, jitter × that delay). It is
// never earlier than minBackoff after g was obtained, so that a broker
// granting absurdly short lifetimes cannot make the agent spin.
func (s schedule) refreshAt(g grant) time.Time {
	delay := time.Duration(float64(g.lifetime()) * s.fraction)
	delay -= s.jittered(delay)
	if delay < s.minBackoff {
		delay = s.minBackoff
	}
	return g.obtainedAt.Add(delay)
}

// backoff returns the wait after the n-th failure in a row (n ≥ 1):
// minBackoff doubled n−1 times, capped at maxBackoff, less a random part
// in [0, jitter × that).
func (s schedule) backoff(n int) time.Duration {
	d := s.minBackoff
	for i := 1; i < n && d < s.maxBackoff; i++ {
		d *= 2
	}
	if d > s.maxBackoff {
		d = s.maxBackoff
	}
	return d - s.jittered(d)
}

// next returns how long to wait, from now, before the next attempt: after
// failures in a row, the backoff (or the broker's Retry-After, if longer,
// within maxBackoff); with no failure and nothing held, at once; else at
// the held grant's refresh time (at once if that has passed).
func (s schedule) next(now time.Time, last *grant, failures int, retryAfter time.Duration) time.Duration {
	if failures > 0 {
		d := s.backoff(failures)
		if retryAfter > d {
			d = min(retryAfter, s.maxBackoff)
		}
		return d
	}
	if last == nil {
		return 0
	}
	return max(s.refreshAt(*last).Sub(now), 0)
}

func (s schedule) jittered(d time.Duration) time.Duration {
	if s.jitter <= 0 || s.rand == nil {
		return 0
	}
	return time.Duration(s.rand.Float64() * s.jitter * float64(d))
}
