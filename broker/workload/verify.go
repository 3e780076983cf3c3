package workload

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
	"go.uber.org/zap"
)

// Identity is a verified ServiceAccount of the caller's (source)
// cluster: the workload a request comes from.
type Identity struct {
	Namespace      string
	ServiceAccount string
	// UID is the ServiceAccount's uid, Pod the pod the token is bound to
	// ("" for a token bound to none).
	UID string
	Pod string
	// PodCertificate says its own pod certificate proved it, without the
	// peer's certificate (Ref's Standalone); PodUID is that Pod's uid.
	PodCertificate bool
	PodUID         string
	// TokenJTI and TokenSHA256 name the token that proved it, for the
	// audit trail; the token itself is never kept.
	TokenJTI    string
	TokenSHA256 string
}

// Ref is the workload's namespace and ServiceAccount, as grants name it.
func (w *Identity) Ref() *policy.WorkloadRef {
	if w == nil {
		return nil
	}
	return &policy.WorkloadRef{Namespace: w.Namespace, ServiceAccount: w.ServiceAccount, Standalone: w.PodCertificate}
}

// String is "namespace/serviceAccount", as leases record it.
func (w *Identity) String() string {
	if w == nil {
		return ""
	}
	return w.Namespace + "/" + w.ServiceAccount
}

// Reason codes of a refused workload token that the broker adds to the
// verifier's (pki.Token*).
const (
	// TokenNoTrust: the peer's policy has no workloadIdentity, so no token
	// of its cluster can be verified.
	TokenNoTrust = "no-trust"
	// TokenNoKeys: the peer uploads its own keys (jwksFromPeer) and has
	// not done so yet.
	TokenNoKeys = "no-keys"
	// TokenRevoked: the token's workload identity is on the broker's deny
	// list (tokenbroker pki revoke --identity <workload identity>).
	TokenRevoked = "revoked"
)

// workloadTokenDetails are the caller-facing details of each reason: they
// say what failed and what to check, and hold nothing of the token.
var workloadTokenDetails = map[string]string{
	pki.TokenMalformed:        "The workload token is not a signed JWT.",
	pki.TokenTooLarge:         fmt.Sprintf("The workload token is longer than %d bytes.", pki.MaxWorkloadTokenBytes),
	pki.TokenUnsupportedAlg:   "The workload token's algorithm is not RS256 or ES256.",
	pki.TokenUnknownKey:       "The workload token's kid is not a key this broker trusts for your cluster; if your cluster's keys rotated, upload them again.",
	pki.TokenBadSignature:     "The workload token's signature does not verify.",
	pki.TokenWrongIssuer:      "The workload token's issuer is not the one this broker trusts for your cluster.",
	pki.TokenWrongAudience:    "The workload token's audience is not one this broker accepts; request the token with the broker's audience.",
	pki.TokenExpired:          "The workload token has expired.",
	pki.TokenNotYetValid:      "The workload token is not valid yet (nbf or iat in the future).",
	pki.TokenMissingClaims:    "The workload token lacks required claims (exp, iat, kubernetes.io namespace and serviceaccount) or they disagree with sub.",
	pki.TokenTooLongLived:     "The workload token lives longer than the maxTokenAge this broker accepts; use a shorter expirationSeconds.",
	pki.TokenPodBindingNeeded: "This broker accepts only pod-bound (projected) workload tokens from your cluster.",
	TokenNoTrust:              "This broker has no workload identity trust for your cluster.",
	TokenNoKeys:               "Your cluster has not uploaded its key set (PUT /v1/peers/self/jwks) to this broker.",
	TokenRevoked:              "This workload is revoked at this broker.",
	TokenPodsUnreported:       "Your cluster has not reported its live Pods (PUT /v1/peers/self/pods) within the time this broker allows; is its agent running?",
	TokenPodNotLive:           "The workload token's Pod is not among the live Pods your cluster last reported, which is newer than the token: the Pod was deleted.",
}

// BadToken returns the KindBadWorkloadToken error of reason with
// its caller-facing detail; cause is for the log.
func BadToken(reason string, cause error) *problem.Error {
	return refused(problem.KindBadWorkloadToken, workloadTokenDetails, "The workload token was refused.", reason, cause)
}

// refused is the error of kind with reason and its caller-facing detail
// from details, fallback when it has none.
func refused(kind problem.Kind, details map[string]string, fallback, reason string, cause error) *problem.Error {
	detail, ok := details[reason]
	if !ok {
		detail = fallback
	}
	return &problem.Error{Kind: kind, Reason: reason, Detail: detail, Err: cause}
}

// checkLivePod is livePodsFromPeer's check of the Pod of uid (named pod,
// for the log) whose proof, a what, was made at issuedAt: nil while the
// peer's last report lists it; a retryable KindUnavailable for a Pod newer
// than the report; else bad's refusal with the reason.
func checkLivePod(store *PeerKeyStore, peer *policy.PeerSpec, identity, pod, uid string, issuedAt time.Time, now func() time.Time,
	what string, bad func(reason string, cause error) *problem.Error) error {
	reason, reportedAt := TokenPodsUnreported, time.Time{}
	if store != nil {
		reason, reportedAt = store.LivePod(peer.Name, identity, uid, now(), peer.WorkloadIdentity.EffectiveLivePodsMaxAge())
	}
	cause := fmt.Errorf("pod %s (uid %s): %s", pod, uid, reason)
	if reason == TokenPodNotLive && !issuedAt.Before(reportedAt.Truncate(time.Second)) {
		// Made after the report: the Pod lived then. Refused for now.
		return &problem.Error{Kind: problem.KindUnavailable, Reason: PodNotReportedYet, RetryAfter: time.Second,
			Detail: "the " + what + "'s Pod is newer than your cluster's last report of its live Pods; retry in a second", Err: cause}
	}
	if reason != "" {
		return bad(reason, cause)
	}
	return nil
}

// TokenFingerprint is "sha256:<hex>" of a token, to name it in logs.
func TokenFingerprint(token string) string {
	sum := sha256.Sum256([]byte(token))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Verify verifies a workload token that a peer of policy p, authenticated
// as identity by its certificate, presented, and returns the workload it
// proves; nil p is KindUnavailable. The trust (issuer, audiences, keys) is the one p pins for that
// peer: a token signed by any other cluster is refused whatever its iss
// says. store holds the key sets peers upload (nil: none). Every refusal is
// KindBadWorkloadToken with a reason code (BadToken).
func Verify(p *policy.Policy, identity, token string, store *PeerKeyStore, now func() time.Time) (*Identity, error) {
	if len(token) > pki.MaxWorkloadTokenBytes {
		return nil, BadToken(pki.TokenTooLarge, fmt.Errorf("token of %d bytes", len(token)))
	}
	if p == nil {
		return nil, policy.ErrNoPolicy
	}
	peer := p.Peer(identity)
	if peer == nil || peer.WorkloadIdentity == nil || !peer.WorkloadIdentity.TrustsTokens() {
		return nil, BadToken(TokenNoTrust, errors.New("the peer's policy has no workloadIdentity for tokens"))
	}
	wi := peer.WorkloadIdentity
	var sets []*pki.JWKS
	if keys := wi.StaticKeys(); keys != nil {
		sets = []*pki.JWKS{keys}
	} else if store != nil {
		sets = store.Keys(peer.Name, identity, now(), wi.EffectiveJWKSOverlap())
	}
	if len(sets) == 0 {
		return nil, BadToken(TokenNoKeys, ErrNoPeerKeys)
	}
	claims, err := pki.VerifyWorkloadToken(token, sets, pki.WorkloadTokenOptions{
		Issuer:            wi.Issuer,
		Audiences:         wi.Audiences,
		MaxTokenAge:       wi.EffectiveMaxTokenAge(),
		RequirePodBinding: wi.RequirePodBinding,
		Now:               now,
	})
	if err != nil {
		var te *pki.WorkloadTokenError
		if errors.As(err, &te) {
			return nil, BadToken(te.Reason, err)
		}
		return nil, BadToken(pki.TokenMalformed, err)
	}
	if wi.LivePodsFromPeer {
		if err := checkLivePod(store, peer, identity, claims.Namespace+"/"+claims.Pod, claims.PodUID, claims.IssuedAt, now, "workload token", BadToken); err != nil {
			return nil, err
		}
	}
	return &Identity{
		Namespace:      claims.Namespace,
		ServiceAccount: claims.ServiceAccount,
		UID:            claims.ServiceAccountUID,
		Pod:            claims.Pod,
		TokenJTI:       claims.JTI,
		TokenSHA256:    TokenFingerprint(token),
	}, nil
}

// Upload stores the key set doc that a peer of policy p, authenticated as
// identity, uploads for its own cluster, and names the peer and the set's
// digest in ev. The peer's policy must say jwksFromPeer: true (else
// KindForbidden, the same answer as for an unknown peer); a store of nil
// keeps none (KindUnprocessable); a document that is not a usable set is
// KindInvalid. Uploading the set in force again changes nothing.
func (s *PeerKeyStore) Upload(ctx context.Context, p *policy.Policy, identity string, doc []byte, now time.Time, ev *audit.Event) (*apiv1.PeerJWKS, error) {
	peer := p.Peer(identity)
	if peer == nil || peer.WorkloadIdentity == nil || !peer.WorkloadIdentity.JWKSFromPeer {
		return nil, problem.Errorf(problem.KindForbidden, "the policy does not let this peer upload its key set")
	}
	ev.Peer = peer.Name
	if s == nil {
		return nil, problem.Errorf(problem.KindUnprocessable, "this broker keeps no uploaded key sets")
	}
	set, err := pki.ParseJWKS(doc)
	if err != nil {
		return nil, problem.Invalid(apiv1.FieldError{Field: "keys", Detail: err.Error()})
	}
	ev.JWKSDigest = set.Digest()
	up, err := s.Put(ctx, peer.Name, identity, doc, set, now, peer.WorkloadIdentity.EffectiveJWKSOverlap())
	if err != nil {
		return nil, err
	}
	s.log.Info("peer key set uploaded", zap.String("peer", peer.Name), zap.Bool("changed", up.Changed),
		zap.Strings("kids", up.Current), zap.String("digest", up.Digest))
	out := &apiv1.PeerJWKS{Peer: peer.Name, KeyIDs: up.Current, Digest: up.Digest, Changed: up.Changed, PreviousKeyIDs: up.Previous}
	if !up.PreviousUntil.IsZero() {
		t := up.PreviousUntil
		out.PreviousUntil = &t
	}
	return out, nil
}
