package policy

import (
	"time"

	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/issuers"
)

// FitIssuer fits decision d to what the issuer of its credential allows
// and returns the TTL to ask the issuer for. The lease lives what was
// asked (minLease at least, ClampedByLeaseMinimum); the credential asks
// the issuer for as much, raised to its minimum (the TokenRequest and CSR
// APIs' 10m), which the lease then cuts short. The issuer's maximum
// shortens the lease too; past a minTTL the caller set, that is
// KindUnprocessable.
func FitIssuer(d *Decision, lim issuers.Limits, minLease, minTTL time.Duration) (time.Duration, error) {
	if d.TTL < minLease {
		d.TTL, d.ClampedBy = minLease, ClampedByLeaseMinimum
	}
	credTTL := d.TTL
	if ttl, by := lim.Clamp(d.TTL); by != "" {
		credTTL = ttl
		if ttl < d.TTL {
			d.TTL, d.ClampedBy = ttl, by
			if minTTL > 0 && d.TTL < minTTL {
				return 0, problem.Errorf(problem.KindUnprocessable,
					"minTTL %s cannot be granted: at most %s is allowed (%s)", minTTL, d.TTL, by)
			}
		}
	}
	return credTTL, nil
}

// Granted is what a credential issued at issueStart and expiring at
// credExpires grants of decision d, whose lease expires at leaseExpires:
// the lease's TTL and clamp, unless the API server (ClampedByAPIServer,
// or ClampedBySigner for a certificate) shortened the credential by more
// than a few seconds, and then what it granted, rounded up to whole
// seconds since the call started ("1h", not "59m59s"). expiresAt is the
// earlier of the two expiries.
func Granted(d Decision, credExpires, leaseExpires, issueStart time.Time, certificate bool) (granted time.Duration, clampedBy string, expiresAt time.Time) {
	granted, clampedBy, expiresAt = d.TTL, d.ClampedBy, leaseExpires
	if credExpires.Before(leaseExpires) {
		expiresAt = credExpires
	}
	if credExpires.Before(leaseExpires.Add(-5 * time.Second)) {
		// The API server's --service-account-max-token-expiration, or
		// the signer's cap.
		left := credExpires.Sub(issueStart)
		granted = left.Truncate(time.Second)
		if left > granted {
			granted += time.Second
		}
		clampedBy = ClampedByAPIServer
		if certificate {
			clampedBy = ClampedBySigner
		}
	}
	return granted, clampedBy, expiresAt
}
