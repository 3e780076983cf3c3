package policy

// Built-in limits, in force when the policy says nothing. Every issuance
// writes a Secret to etcd, so they are on by default: an agent asks a few
// times an hour per target, a person's kubectl plugin once per refresh
// point; 60 a minute with a burst of 30 is far above either and still
// caps a peer in a loop at 3,600 Secrets an hour, of which at most
// DefaultMaxLiveLeases live at once.
const (
	DefaultIssuancesPerMinute   = 60
	DefaultIssuanceBurst        = 30
	DefaultRenewalsPerMinute    = 6
	DefaultMaxLiveLeases        = 1000
	DefaultEnrollmentsPerMinute = 10
	// DefaultLeaseReadsPerMinute bounds GET /v1/leases (a page), GET and
	// DELETE /v1/leases/{id} of one identity, each an API server list at
	// most: an agent revokes once per refresh, a person pages a listing;
	// 120 a minute (burst the same) is far above either.
	DefaultLeaseReadsPerMinute = 120
	// DefaultLeaseReadsInFlight is how many of those one identity may have
	// waiting on the API server at once.
	DefaultLeaseReadsInFlight = 4
)

// LimitsSpec bounds what one peer can make the broker do. In the policy's
// top level it sets the defaults of every peer (enrollmentsPerMinute only
// there); in peers[].limits it overrides them for one peer. A field left
// out inherits; every value given must be at least 1.
type LimitsSpec struct {
	// IssuancesPerMinute and Burst are the token bucket of POST
	// /v1/kubeconfigs (with or without format=exec): a peer may ask Burst
	// times at once, then IssuancesPerMinute a minute.
	IssuancesPerMinute *int `json:"issuancesPerMinute,omitempty"`
	Burst              *int `json:"burst,omitempty"`
	// RenewalsPerMinute is the bucket (burst: the same figure) of
	// certificate renewals.
	RenewalsPerMinute *int `json:"renewalsPerMinute,omitempty"`
	// MaxLiveLeases is how many unexpired leases the peer may hold.
	MaxLiveLeases *int `json:"maxLiveLeases,omitempty"`
	// EnrollmentsPerMinute is the bucket (burst: the same figure) of
	// enrollments per source address and per join token; top level only.
	EnrollmentsPerMinute *int `json:"enrollmentsPerMinute,omitempty"`
	// LeaseReadsPerMinute is the bucket (burst: the same figure) of GET
	// /v1/leases, GET and DELETE /v1/leases/{id} per identity, and
	// LeaseReadsInFlight how many of them may wait on the API server at
	// once.
	LeaseReadsPerMinute *int `json:"leaseReadsPerMinute,omitempty"`
	LeaseReadsInFlight  *int `json:"leaseReadsInFlight,omitempty"`
}

// Limits are the limits in force for one peer, all filled in.
type Limits struct {
	IssuancesPerMinute int
	Burst              int
	RenewalsPerMinute  int
	MaxLiveLeases      int
	// LeaseReadsPerMinute and LeaseReadsInFlight bound lease reads.
	LeaseReadsPerMinute int
	LeaseReadsInFlight  int
}

func pick(vals ...*int) int {
	for _, v := range vals {
		if v != nil {
			return *v
		}
	}
	return 0
}

func ptr(v int) *int { return &v }

// limitsFor is what applies to peer: its own limits, else the policy's,
// else the built-in ones.
func (p *Policy) LimitsFor(peer *PeerSpec) Limits {
	var own, top LimitsSpec
	if peer != nil && peer.Limits != nil {
		own = *peer.Limits
	}
	if p.Limits != nil {
		top = *p.Limits
	}
	return Limits{
		IssuancesPerMinute:  pick(own.IssuancesPerMinute, top.IssuancesPerMinute, ptr(DefaultIssuancesPerMinute)),
		Burst:               pick(own.Burst, top.Burst, ptr(DefaultIssuanceBurst)),
		RenewalsPerMinute:   pick(own.RenewalsPerMinute, top.RenewalsPerMinute, ptr(DefaultRenewalsPerMinute)),
		MaxLiveLeases:       pick(own.MaxLiveLeases, top.MaxLiveLeases, ptr(DefaultMaxLiveLeases)),
		LeaseReadsPerMinute: pick(own.LeaseReadsPerMinute, top.LeaseReadsPerMinute, ptr(DefaultLeaseReadsPerMinute)),
		LeaseReadsInFlight:  pick(own.LeaseReadsInFlight, top.LeaseReadsInFlight, ptr(DefaultLeaseReadsInFlight)),
	}
}

// enrollmentsPerMinute is the enrollment bucket of the policy.
func (p *Policy) EnrollmentsPerMinute() int {
	if p.Limits != nil && p.Limits.EnrollmentsPerMinute != nil {
		return *p.Limits.EnrollmentsPerMinute
	}
	return DefaultEnrollmentsPerMinute
}

// maxLimit bounds every figure: a million a minute is no limit at all,
// and keeps the arithmetic far from overflow.
const maxLimit = 1_000_000

// validateLimits adds the problems of one limits section at path.
func validateLimits(add func(field, format string, args ...any), path string, l *LimitsSpec, top bool) {
	if l == nil {
		return
	}
	for _, f := range []struct {
		name string
		v    *int
	}{
		{"issuancesPerMinute", l.IssuancesPerMinute}, {"burst", l.Burst}, {"renewalsPerMinute", l.RenewalsPerMinute},
		{"maxLiveLeases", l.MaxLiveLeases}, {"enrollmentsPerMinute", l.EnrollmentsPerMinute},
		{"leaseReadsPerMinute", l.LeaseReadsPerMinute}, {"leaseReadsInFlight", l.LeaseReadsInFlight},
	} {
		if f.v != nil && (*f.v < 1 || *f.v > maxLimit) {
			add(path+"."+f.name, "must be between 1 and %d", maxLimit)
		}
	}
	if !top && l.EnrollmentsPerMinute != nil {
		add(path+".enrollmentsPerMinute", "is a top-level limit: an enrolling cluster is no peer yet")
	}
}
