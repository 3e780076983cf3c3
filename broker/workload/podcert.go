package workload

import (
	"errors"
	"fmt"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Reason codes of a refused pod certificate (KindBadPodCertificate); the
// live Pods' reasons are the tokens' (TokenPodsUnreported,
// TokenPodNotLive).
const (
	// PodCertificatesOff: the peer's policy accepts no pod certificates
	// (no workloadIdentity.podCertificates).
	PodCertificatesOff = "pod-certificates-off"
)

var podCertificateDetails = map[string]string{
	PodCertificatesOff:  "This broker accepts no pod certificates from your cluster (its policy's workloadIdentity.podCertificates).",
	TokenPodsUnreported: "Your cluster has not reported its live Pods (PUT /v1/peers/self/pods) within the time this broker allows; is its agent running?",
	TokenPodNotLive:     "The pod certificate's Pod is not among the live Pods your cluster last reported, which is newer than the certificate: the Pod was deleted.",
}

// BadPodCertificate returns the KindBadPodCertificate error of reason
// with its caller-facing detail; cause is for the log.
func BadPodCertificate(reason string, cause error) *problem.Error {
	return refused(problem.KindBadPodCertificate, podCertificateDetails, "The pod certificate was refused.", reason, cause)
}

// VerifyPodCertificate decides whether the workload w, read from a
// verified pod certificate (pki.WorkloadFromChain), is one a peer of p
// may speak for, and returns it as an Identity. The peer is the one whose
// identity is w.Cluster, the cluster of the CA that signed it; its
// policy must say workloadIdentity.podCertificates. With livePodsFromPeer
// the Pod must be in the peer's last report, as for a pod-bound token:
// issuedAt is when the certificate was made (its NotBefore less the
// signer's backdating). nil p is KindUnavailable; every refusal is
// KindBadPodCertificate with a reason code.
func VerifyPodCertificate(p *policy.Policy, w *pki.PodWorkload, issuedAt time.Time, store *PeerKeyStore, now func() time.Time) (*Identity, error) {
	if p == nil {
		return nil, policy.ErrNoPolicy
	}
	peer := p.Peer(w.Cluster)
	if peer == nil || peer.WorkloadIdentity == nil || !peer.WorkloadIdentity.PodCertificates {
		return nil, BadPodCertificate(PodCertificatesOff, fmt.Errorf("the policy of %s accepts no pod certificates", w.Cluster))
	}
	if peer.WorkloadIdentity.LivePodsFromPeer {
		if err := checkLivePod(store, peer, w.Cluster, w.Namespace+"/"+w.PodName, w.PodUID, issuedAt, now, "pod certificate", BadPodCertificate); err != nil {
			return nil, err
		}
	}
	if w.Namespace == "" || w.ServiceAccount == "" || w.PodUID == "" {
		return nil, BadPodCertificate("", errors.New("the pod certificate names no workload"))
	}
	return &Identity{
		Namespace:      w.Namespace,
		ServiceAccount: w.ServiceAccount,
		Pod:            w.PodName,
		PodCertificate: true,
		PodUID:         w.PodUID,
	}, nil
}

// VerifyAgentPodCertificate decides whether the pod certificate of w,
// whose workload peer names its agent (policy.PeerSpec.IsAgent), may
// speak for peer now. Nothing of workloadIdentity is needed but
// livePodsFromPeer, which holds the agent's Pod to the peer's last
// report as it holds a workload's (the same reasons and the same 503).
// That report is never the agent's pod certificate's to write (the route
// takes the cluster's client certificate alone): a certificate of a
// deleted agent Pod could otherwise report itself live again.
func VerifyAgentPodCertificate(peer *policy.PeerSpec, w *pki.PodWorkload, issuedAt time.Time, store *PeerKeyStore, now func() time.Time) error {
	if peer == nil || !peer.IsAgent(w.Namespace, w.ServiceAccount) || peer.Identity != w.Cluster || w.PodUID == "" {
		return BadPodCertificate("", fmt.Errorf("%s is not the agent of the peer of %s", w.Identity, w.Cluster))
	}
	if peer.WorkloadIdentity == nil || !peer.WorkloadIdentity.LivePodsFromPeer {
		return nil
	}
	return checkLivePod(store, peer, w.Cluster, w.Namespace+"/"+w.PodName, w.PodUID, issuedAt, now, "agent's pod certificate", BadPodCertificate)
}
