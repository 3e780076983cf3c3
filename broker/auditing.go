package broker

import (
	"context"

	"github.com/tokenbroker/tokenbroker/broker/audit"
)

// RefuseCaller records a caller the transport refused (401) in the audit
// trail and the denial metrics: c holds what is known of it (identity and
// certificate fingerprint, either may be empty), code is one of the
// Refused* constants and reason says why.
func (b *Broker) RefuseCaller(ctx context.Context, c Caller, code, reason string) {
	a := &audit.Pending{Event: audit.Event{Action: audit.ActionAuthenticate, Identity: c.Identity, CertSHA256: c.CertSHA256}}
	b.recorder().Conclude(ctx, a, audit.DecisionDeny, reason, code)
}

// recorder writes the broker's audit events with its clock and metrics,
// as configured now.
func (b *Broker) recorder() *audit.Recorder {
	return &audit.Recorder{Auditor: b.cfg.Auditor, Now: b.cfg.Clock.Now, Logger: b.cfg.Logger, Metrics: b.cfg.Metrics}
}
