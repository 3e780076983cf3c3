package broker

import (
	"context"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
)

// authority is the CA side (enrollment.Authority) with the broker's
// configuration as it is now.
func (b *Broker) authority() *enrollment.Authority {
	cfg := b.cfg.Enrollment
	cfg.JoinTokens = b.joinTokens
	return &enrollment.Authority{Config: cfg, Policy: b.cfg.Policy, Secrets: b.cfg.Secrets, Namespace: b.cfg.Namespace,
		Limits: b.admission(), Audit: b.recorder(), Metrics: b.cfg.Metrics, Clock: b.cfg.Clock, Logger: b.cfg.Logger, Timed: b.timeAPI}
}

// joinTokenAudiences are the aud values this broker accepts in a join
// token (enrollment.JoinTokenAudiences), read at every verification.
func (b *Broker) joinTokenAudiences() []string {
	return enrollment.JoinTokenAudiences(b.cfg.Enrollment.BrokerNames, b.cfg.Policy, b.cfg.Enrollment.AcceptUnboundJoinTokens)
}

// Enroll issues a new cluster's first client certificate for the join
// token it presented (enrollment.Authority.Enroll); the caller's address
// (RemoteAddr) keys the enrollment limits.
func (b *Broker) Enroll(ctx context.Context, token string, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	return b.authority().Enroll(ctx, RemoteAddr(ctx), token, req)
}

// Renew issues a new certificate to a caller authenticated by its
// current one (enrollment.Authority.Renew).
func (b *Broker) Renew(ctx context.Context, c Caller, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	return b.authority().Renew(ctx, enrollment.Peer{Identity: c.Identity, CertSHA256: c.CertSHA256, Certificate: c.Certificate}, req)
}

// TrustBundle returns the CA bundle in force and the fingerprints of its
// certificates; both are empty when the broker has no TrustSource.
func (b *Broker) TrustBundle() apiv1.TrustBundle { return b.authority().TrustBundle() }

// RevokedPod reports whether the Pod of uid is on the deny list; false
// when the broker has no RevocationList.
func (b *Broker) RevokedPod(uid string) bool {
	return b.cfg.Enrollment.Revocations != nil && b.cfg.Enrollment.Revocations.RevokedPod(uid)
}

// Revoked reports whether a caller's identity or one of its certificate
// serials (hexadecimal, see enrollment.NormalizeSerial) is on the deny
// list; false when the broker has no RevocationList.
func (b *Broker) Revoked(identity string, serials ...string) bool {
	return b.cfg.Enrollment.Revocations != nil && b.cfg.Enrollment.Revocations.Revoked(identity, serials...)
}
