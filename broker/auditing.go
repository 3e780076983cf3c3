package broker

import (
	"context"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"go.uber.org/zap"
)

// RefuseCaller records a caller the transport refused (401) in the audit
// trail and the denial metrics: c holds what is known of it (identity and
// certificate fingerprint, either may be empty), code is one of the
// Refused* constants and reason says why.
func (b *Broker) RefuseCaller(ctx context.Context, c Caller, code, reason string) {
	a := &pendingAudit{ev: audit.Event{Action: audit.ActionAuthenticate, Identity: c.Identity, CertSHA256: c.CertSHA256}}
	b.conclude(ctx, a, audit.DecisionDeny, reason, code)
}

// audit completes ev and hands it to the configured Auditor; a failed
// write is logged and counted but does not fail the request, whose
// decision the operational log also records.
func (b *Broker) audit(ctx context.Context, ev audit.Event) {
	ev.Audit = audit.Schema
	ev.Time = b.cfg.Clock.Now().UTC()
	if ev.RequestID == "" {
		ev.RequestID = audit.RequestID(ctx)
	}
	if b.cfg.Auditor == nil {
		return
	}
	err := b.cfg.Auditor.Audit(ev)
	b.cfg.Metrics.ObserveAudit(ev.Action, ev.Decision, err)
	if err != nil {
		b.cfg.Logger.Error("audit event not written",
			zap.Error(err), zap.String("action", ev.Action), zap.String("decision", ev.Decision),
			zap.String("request_id", ev.RequestID))
	}
}
