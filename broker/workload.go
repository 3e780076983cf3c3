package broker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"go.uber.org/zap"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Reason codes of a refused workload token that the broker adds to the
// verifier's (pki.Token*).
const (
	// TokenNoTrust: the peer's policy has no workloadIdentity, so no token
	// of its cluster can be verified.
	TokenNoTrust = "no-trust"
	// TokenNoKeys: the peer uploads its own keys (jwksFromPeer) and has
	// not done so yet.
	TokenNoKeys = "no-keys"
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
}

// BadWorkloadToken returns the KindBadWorkloadToken error of reason with
// its caller-facing detail; cause is for the log.
func BadWorkloadToken(reason string, cause error) *problem.Error {
	detail, ok := workloadTokenDetails[reason]
	if !ok {
		detail = "The workload token was refused."
	}
	return &problem.Error{Kind: problem.KindBadWorkloadToken, Reason: reason, Detail: detail, Err: cause}
}

// TokenFingerprint is "sha256:<hex>" of a token, to name it in logs.
func TokenFingerprint(token string) string {
	sum := sha256.Sum256([]byte(token))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// AuthenticateWorkload verifies a workload token that caller (a peer
// authenticated by its certificate) presented and returns the caller with
// its Workload set. The trust (issuer, audiences, keys) is the one the
// policy pins for caller's peer: a token signed by any other cluster is
// refused whatever its iss says. Every refusal is KindBadWorkloadToken
// with a reason code, and is audited (ActionAuthenticate) with the token's
// fingerprint, never the token.
func (b *Broker) AuthenticateWorkload(ctx context.Context, c Caller, token string) (Caller, error) {
	w, err := b.verifyWorkload(c, token)
	if err != nil {
		var be *problem.Error
		reason := ""
		if errors.As(err, &be) {
			reason = be.Reason
		}
		a := &audit.Pending{Event: audit.Event{Action: audit.ActionAuthenticate, Identity: c.Identity, CertSHA256: c.CertSHA256, WorkloadTokenSHA256: TokenFingerprint(token)}}
		if p := b.cfg.Policy.Load(); p != nil {
			if peer := p.Peer(c.Identity); peer != nil {
				a.Event.Peer = peer.Name
			}
		}
		b.recorder().Conclude(ctx, a, audit.DecisionDeny, "workload token refused: "+reason, audit.DenyWorkloadToken)
		b.cfg.Logger.Info("workload token refused", zap.String("identity", c.Identity),
			zap.String("reason", reason), zap.String("token_sha256", TokenFingerprint(token)), zap.Error(err))
		return c, err
	}
	c.Workload = w
	return c, nil
}

func (b *Broker) verifyWorkload(c Caller, token string) (*Workload, error) {
	if len(token) > pki.MaxWorkloadTokenBytes {
		return nil, BadWorkloadToken(pki.TokenTooLarge, fmt.Errorf("token of %d bytes", len(token)))
	}
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	peer := p.Peer(c.Identity)
	if peer == nil || peer.WorkloadIdentity == nil {
		return nil, BadWorkloadToken(TokenNoTrust, errors.New("the peer's policy has no workloadIdentity"))
	}
	wi := peer.WorkloadIdentity
	var sets []*pki.JWKS
	if keys := wi.StaticKeys(); keys != nil {
		sets = []*pki.JWKS{keys}
	} else if b.cfg.PeerKeys != nil {
		sets = b.cfg.PeerKeys.Keys(peer.Name, c.Identity, b.cfg.Clock.Now(), wi.EffectiveJWKSOverlap())
	}
	if len(sets) == 0 {
		return nil, BadWorkloadToken(TokenNoKeys, workload.ErrNoPeerKeys)
	}
	claims, err := pki.VerifyWorkloadToken(token, sets, pki.WorkloadTokenOptions{
		Issuer:            wi.Issuer,
		Audiences:         wi.Audiences,
		MaxTokenAge:       wi.EffectiveMaxTokenAge(),
		RequirePodBinding: wi.RequirePodBinding,
		Now:               b.cfg.Clock.Now,
	})
	if err != nil {
		var te *pki.WorkloadTokenError
		if errors.As(err, &te) {
			return nil, BadWorkloadToken(te.Reason, err)
		}
		return nil, BadWorkloadToken(pki.TokenMalformed, err)
	}
	return &Workload{
		Namespace:      claims.Namespace,
		ServiceAccount: claims.ServiceAccount,
		UID:            claims.ServiceAccountUID,
		Pod:            claims.Pod,
		TokenJTI:       claims.JTI,
		TokenSHA256:    TokenFingerprint(token),
	}, nil
}

// PutPeerJWKS stores the key set a peer uploads for its own cluster (PUT
// /v1/peers/self/jwks). The peer's policy must say jwksFromPeer: true
// (else KindForbidden, the same answer as for an unknown peer); a document
// that is not a usable set is KindInvalid. Uploading the set in force
// again changes nothing.
func (b *Broker) PutPeerJWKS(ctx context.Context, c Caller, doc []byte) (*apiv1.PeerJWKS, error) {
	a := &audit.Pending{Event: audit.Event{Action: audit.ActionUploadJWKS, Identity: c.Identity, CertSHA256: c.CertSHA256}}
	resp, err := b.putPeerJWKS(ctx, c, doc, a)
	outcome := outcomeGranted
	if err != nil {
		outcome = outcomeFor(err)
	}
	b.concludeOutcome(ctx, a, outcome, err)
	return resp, err
}

func (b *Broker) putPeerJWKS(ctx context.Context, c Caller, doc []byte, a *audit.Pending) (*apiv1.PeerJWKS, error) {
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	peer := p.Peer(c.Identity)
	if peer == nil || peer.WorkloadIdentity == nil || !peer.WorkloadIdentity.JWKSFromPeer {
		return nil, problem.Errorf(problem.KindForbidden, "the policy does not let this peer upload its key set")
	}
	a.Event.Peer = peer.Name
	if b.cfg.PeerKeys == nil {
		return nil, problem.Errorf(problem.KindUnprocessable, "this broker keeps no uploaded key sets")
	}
	set, err := pki.ParseJWKS(doc)
	if err != nil {
		return nil, problem.Invalid(apiv1.FieldError{Field: "keys", Detail: err.Error()})
	}
	a.Event.JWKSDigest = set.Digest()
	up, err := b.cfg.PeerKeys.Put(ctx, peer.Name, c.Identity, doc, set, b.cfg.Clock.Now(), peer.WorkloadIdentity.EffectiveJWKSOverlap())
	if err != nil {
		return nil, err
	}
	b.cfg.Logger.Info("peer key set uploaded", zap.String("peer", peer.Name), zap.Bool("changed", up.Changed),
		zap.Strings("kids", up.Current), zap.String("digest", up.Digest))
	out := &apiv1.PeerJWKS{Peer: peer.Name, KeyIDs: up.Current, Digest: up.Digest, Changed: up.Changed, PreviousKeyIDs: up.Previous}
	if !up.PreviousUntil.IsZero() {
		t := up.PreviousUntil
		out.PreviousUntil = &t
	}
	return out, nil
}
