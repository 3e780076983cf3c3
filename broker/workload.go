package broker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
)

// AuthenticateWorkload verifies a workload token that caller (a peer
// authenticated by its certificate) presented and returns the caller with
// its Workload set. The trust (issuer, audiences, keys) is the one the
// policy pins for caller's peer: a token signed by any other cluster is
// refused whatever its iss says. Every refusal is KindBadWorkloadToken
// with a reason code, and is audited (ActionAuthenticate) with the token's
// fingerprint, never the token.
func (b *Broker) AuthenticateWorkload(ctx context.Context, c Caller, token string) (Caller, error) {
	w, err := workload.Verify(b.cfg.Policy.Load(), c.Identity, token, b.cfg.PeerKeys, b.cfg.Clock.Now)
	if err == nil {
		// A workload identity on the deny list is refused whatever proves
		// it, a token as well as a pod certificate.
		if id, idErr := pki.WorkloadIdentity(c.Identity, w.Namespace, w.ServiceAccount); idErr == nil && b.Revoked(id) {
			err = workload.BadToken(workload.TokenRevoked, fmt.Errorf("workload %s is revoked", id))
		}
	}
	if err != nil {
		var be *problem.Error
		reason := ""
		if errors.As(err, &be) {
			reason = be.Reason
		}
		a := &audit.Pending{Event: c.event(audit.ActionAuthenticate)}
		a.Event.WorkloadTokenSHA256 = workload.TokenFingerprint(token)
		if p := b.cfg.Policy.Load(); p != nil {
			if peer := p.Peer(c.Identity); peer != nil {
				a.Event.Peer = peer.Name
			}
		}
		b.recorder().Conclude(ctx, a, audit.DecisionDeny, "workload token refused: "+reason, audit.DenyWorkloadToken)
		b.cfg.Logger.Info("workload token refused", zap.String("identity", c.Identity),
			zap.String("reason", reason), zap.String("token_sha256", workload.TokenFingerprint(token)), zap.Error(err))
		return c, err
	}
	c.Workload = w
	return c, nil
}

// AuthenticatePodCertificate decides who the caller's verified pod
// certificate (pki.WorkloadFromChain; c.Identity is the cluster of the CA
// that signed it, w what it says) speaks for, and returns the caller so:
//
//   - the peer itself, Agent set and Workload nil, when w is the workload
//     the peer's policy names its agent (peers[].agent): it needs no
//     workloadIdentity, and with livePodsFromPeer its Pod must be live,
//     in a report made with the cluster's client certificate (the
//     report's route takes no pod certificate);
//   - otherwise a workload of the peer's cluster, Workload set: the
//     peer's policy must accept pod certificates, and with
//     livePodsFromPeer the Pod must be live.
//
// The policy is read once, so a reload applies from the next request.
// Every refusal is audited; it is KindBadPodCertificate with a Reason, or
// KindUnavailable for a Pod newer than the peer's last report.
func (b *Broker) AuthenticatePodCertificate(ctx context.Context, c Caller, w *pki.PodWorkload) (Caller, error) {
	issuedAt := time.Time{}
	if c.Certificate != nil {
		issuedAt = c.Certificate.NotBefore.Add(pki.PodCertificateBackdate)
	}
	p := b.cfg.Policy.Load()
	var peer *policy.PeerSpec
	if p != nil {
		peer = p.Peer(w.Cluster)
	}
	var id *workload.Identity
	var err error
	agent := peer.IsAgent(w.Namespace, w.ServiceAccount)
	if agent {
		err = workload.VerifyAgentPodCertificate(peer, w, issuedAt, b.cfg.PeerKeys, b.cfg.Clock.Now)
	} else {
		id, err = workload.VerifyPodCertificate(p, w, issuedAt, b.cfg.PeerKeys, b.cfg.Clock.Now)
	}
	if err != nil {
		var be *problem.Error
		reason := ""
		if errors.As(err, &be) {
			reason = be.Reason
		}
		a := &audit.Pending{Event: c.event(audit.ActionAuthenticate)}
		namePod(&a.Event, agent, w.Namespace, w.ServiceAccount, w.PodName, w.PodUID)
		if peer != nil {
			a.Event.Peer = peer.Name
		}
		b.recorder().Conclude(ctx, a, audit.DecisionDeny, "pod certificate refused: "+reason, audit.DenyPodCertificate)
		b.cfg.Logger.Info("pod certificate refused", zap.String("identity", c.Identity), zap.String("workload", w.Identity),
			zap.String("pod_uid", w.PodUID), zap.Bool("agent", agent), zap.String("reason", reason), zap.Error(err))
		return c, err
	}
	if agent {
		c.Agent = w
		return c, nil
	}
	c.Workload = id
	return c, nil
}

// PutPeerJWKS stores the key set a peer uploads for its own cluster (PUT
// /v1/peers/self/jwks). The peer's policy must say jwksFromPeer: true
// (else KindForbidden, the same answer as for an unknown peer); a document
// that is not a usable set is KindInvalid. Uploading the set in force
// again changes nothing.
func (b *Broker) PutPeerJWKS(ctx context.Context, c Caller, doc []byte) (*apiv1.PeerJWKS, error) {
	a := &audit.Pending{Event: c.event(audit.ActionUploadJWKS)}
	var resp *apiv1.PeerJWKS
	p, err := b.policy()
	if err == nil {
		resp, err = b.cfg.PeerKeys.Upload(ctx, p, c.Identity, doc, b.cfg.Clock.Now(), &a.Event)
	}
	outcome := outcomeGranted
	if err != nil {
		outcome = outcomeFor(err)
	}
	b.concludeOutcome(ctx, a, outcome, err)
	return resp, err
}

// ReportPeerPods stores the uids of the Pods that live in the caller's
// cluster (PUT /v1/peers/self/pods). The peer's policy must say
// livePodsFromPeer: true (else KindForbidden).
func (b *Broker) ReportPeerPods(ctx context.Context, c Caller, uids []string) (*apiv1.PeerLivePods, error) {
	a := &audit.Pending{Event: c.event(audit.ActionReportPods)}
	var resp *apiv1.PeerLivePods
	p, err := b.policy()
	if err == nil {
		resp, err = b.cfg.PeerKeys.ReportLivePods(ctx, p, c.Identity, uids, b.cfg.Clock.Now(), &a.Event)
	}
	outcome := outcomeGranted
	if err != nil {
		outcome = outcomeFor(err)
	}
	b.concludeOutcome(ctx, a, outcome, err)
	return resp, err
}
