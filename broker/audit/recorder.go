package audit

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// Observer counts what a Recorder writes; *metrics.Metrics is one (a nil
// *metrics.Metrics counts nothing).
type Observer interface {
	// ObserveAudit counts one event written, or not written when
	// writeErr is set.
	ObserveAudit(action, decision string, writeErr error)
	// ObserveDenial counts one refusal under its reason code.
	ObserveDenial(action, reason string)
}

// Pending is what one request learns for its audit event as it goes.
type Pending struct {
	Event Event
	// Denial is the reason code of a refusal for
	// tokenbroker_denials_total, when the outcome alone does not tell it.
	Denial string
	// Reason, if set, is the audit reason instead of the caller-facing
	// detail (which, for a join token, is the same for every failure).
	Reason string
}

// Recorder completes events and hands them to an Auditor. A failed write
// is logged and counted but fails nothing: the decision stands, and the
// operational log records it too.
type Recorder struct {
	// Auditor receives the events; nil writes none.
	Auditor Auditor
	// Now stamps every event.
	Now     func() time.Time
	Logger  *zap.Logger
	Metrics Observer
}

// Write completes ev (schema, time, the request id of ctx unless set)
// and writes it.
func (r *Recorder) Write(ctx context.Context, ev Event) {
	ev.Audit = Schema
	ev.Time = r.Now().UTC()
	if ev.RequestID == "" {
		ev.RequestID = RequestID(ctx)
	}
	if r.Auditor == nil {
		return
	}
	err := r.Auditor.Audit(ev)
	if r.Metrics != nil {
		r.Metrics.ObserveAudit(ev.Action, ev.Decision, err)
	}
	if err != nil {
		r.Logger.Error("audit event not written",
			zap.Error(err), zap.String("action", ev.Action), zap.String("decision", ev.Decision),
			zap.String("request_id", ev.RequestID))
	}
}

// Conclude writes p's event with its decision and reason (p.Reason if
// set) and counts a denial under p.Denial, else under denial.
func (r *Recorder) Conclude(ctx context.Context, p *Pending, decision, reason, denial string) {
	p.Event.Decision, p.Event.Reason = decision, reason
	if p.Reason != "" {
		p.Event.Reason = p.Reason
	}
	if decision == DecisionDeny && r.Metrics != nil {
		if p.Denial != "" {
			denial = p.Denial
		}
		r.Metrics.ObserveDenial(p.Event.Action, denial)
	}
	r.Write(ctx, p.Event)
}
