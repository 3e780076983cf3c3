package pki

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Bounds and defaults of workload tokens: ServiceAccount tokens of a peer
// cluster that name the workload asking.
const (
	// MaxWorkloadTokenBytes bounds a workload token. A projected
	// ServiceAccount token is about 1 KiB; 8 KiB leaves room for long
	// names and several audiences.
	MaxWorkloadTokenBytes = 8 << 10
	// WorkloadTokenLeeway is the clock skew allowed between the peer
	// cluster and the broker for exp, nbf and iat.
	WorkloadTokenLeeway = 30 * time.Second
	// DefaultMaxWorkloadTokenAge is the longest exp − iat accepted unless
	// the peer's workloadIdentity.maxTokenAge says otherwise. Kubernetes
	// makes default projected tokens valid for a year when
	// --service-account-extend-token-expiration is on; such a token is
	// refused.
	DefaultMaxWorkloadTokenAge = time.Hour
)

// Reason codes of a refused workload token. They say what failed, never
// what the token holds, and are shown to the caller.
const (
	TokenMalformed        = "malformed"
	TokenTooLarge         = "too-large"
	TokenUnsupportedAlg   = "unsupported-algorithm"
	TokenUnknownKey       = "unknown-key"
	TokenBadSignature     = "bad-signature"
	TokenWrongIssuer      = "wrong-issuer"
	TokenWrongAudience    = "wrong-audience"
	TokenExpired          = "expired"
	TokenNotYetValid      = "not-yet-valid"
	TokenMissingClaims    = "missing-claims"
	TokenTooLongLived     = "too-long-lived"
	TokenPodBindingNeeded = "pod-binding-required"
)

// WorkloadTokenError is a refused workload token: a reason code (one of
// the Token* constants) and the cause, for the log. Neither holds the
// token.
type WorkloadTokenError struct {
	Reason string
	Err    error
}

func (e *WorkloadTokenError) Error() string {
	return fmt.Sprintf("workload token refused (%s): %v", e.Reason, e.Err)
}

func (e *WorkloadTokenError) Unwrap() error { return e.Err }

func tokenErr(reason string, format string, args ...any) *WorkloadTokenError {
	return &WorkloadTokenError{Reason: reason, Err: fmt.Errorf(format, args...)}
}

// WorkloadTokenOptions are the checks of one peer's trust.
type WorkloadTokenOptions struct {
	// Issuer is the exact iss the peer's cluster writes.
	Issuer string
	// Audiences: the token's aud must contain one of them.
	Audiences []string
	// MaxTokenAge caps exp − iat; zero means DefaultMaxWorkloadTokenAge.
	MaxTokenAge time.Duration
	// RequirePodBinding refuses tokens not bound to a pod.
	RequirePodBinding bool
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// WorkloadClaims is what a verified workload token says.
type WorkloadClaims struct {
	Namespace          string
	ServiceAccount     string
	ServiceAccountUID  string
	Pod, PodUID        string
	JTI                string
	KeyID              string
	IssuedAt, Expires  time.Time
	BoundToPod         bool
	BoundToSecret      bool
	BoundToNode        bool
	ServiceAccountUser string
}

// workloadJWTClaims are the claims of a Kubernetes ServiceAccount token.
type workloadJWTClaims struct {
	jwt.RegisteredClaims
	Kubernetes *struct {
		Namespace      string   `json:"namespace"`
		ServiceAccount *objRef  `json:"serviceaccount"`
		Pod            *objRef  `json:"pod"`
		Secret         *objRef  `json:"secret"`
		Node           *objRef  `json:"node"`
		WarnAfter      *float64 `json:"warnafter"`
	} `json:"kubernetes.io"`
}

type objRef struct {
	Name string `json:"name"`
	UID  string `json:"uid"`
}

// errUnknownKey is what the key function returns for a kid in no set.
var errUnknownKey = errors.New("no key with the token's kid")

// VerifyWorkloadToken verifies a ServiceAccount token of a peer cluster
// against the peer's key sets (tried in order; a kid is looked up in each)
// and its options: RS256 or ES256 only, kid known, iss exact, aud holding
// one of ours, exp required, nbf and iat not in the future (with
// WorkloadTokenLeeway), exp − iat at most MaxTokenAge, the kubernetes.io
// claims present and consistent with sub, and a pod binding when asked.
// Every failure is a *WorkloadTokenError.
func VerifyWorkloadToken(token string, sets []*JWKS, o WorkloadTokenOptions) (WorkloadClaims, error) {
	if len(token) > MaxWorkloadTokenBytes {
		return WorkloadClaims{}, tokenErr(TokenTooLarge, "token is %d bytes, over the limit of %d", len(token), MaxWorkloadTokenBytes)
	}
	if strings.Count(token, ".") != 2 {
		return WorkloadClaims{}, tokenErr(TokenMalformed, "not a signed JWT (three dot-separated parts)")
	}
	now := o.Now
	if now == nil {
		now = time.Now
	}
	maxAge := o.MaxTokenAge
	if maxAge <= 0 {
		maxAge = DefaultMaxWorkloadTokenAge
	}
	if o.Issuer == "" || len(o.Audiences) == 0 {
		return WorkloadClaims{}, tokenErr(TokenWrongIssuer, "no issuer or audience is configured for this peer")
	}
	parser := jwt.NewParser(
		jwt.WithValidMethods([]string{jwt.SigningMethodRS256.Alg(), jwt.SigningMethodES256.Alg()}),
		jwt.WithIssuer(o.Issuer),
		jwt.WithAudience(o.Audiences...),
		jwt.WithExpirationRequired(),
		jwt.WithIssuedAt(),
		jwt.WithLeeway(WorkloadTokenLeeway),
		jwt.WithTimeFunc(now),
	)
	var keyID string
	var claims workloadJWTClaims
	tok, err := parser.ParseWithClaims(token, &claims, func(t *jwt.Token) (any, error) {
		kid, _ := t.Header["kid"].(string)
		keyID = kid
		for _, s := range sets {
			if key, alg, ok := s.Key(kid); ok {
				// A key verifies the one algorithm of its type: an RSA
				// key never verifies an ES256 token and the reverse.
				if alg != t.Method.Alg() {
					return nil, fmt.Errorf("key %q is for %s, the token says %s: %w", kid, alg, t.Method.Alg(), errUnknownKey)
				}
				return key, nil
			}
		}
		return nil, errUnknownKey
	})
	if err != nil {
		return WorkloadClaims{}, classifyJWTError(tok, err)
	}
	c := &claims
	if c.IssuedAt == nil {
		return WorkloadClaims{}, tokenErr(TokenMissingClaims, "iat is required")
	}
	if age := c.ExpiresAt.Sub(c.IssuedAt.Time); age > maxAge {
		return WorkloadClaims{}, tokenErr(TokenTooLongLived, "token lives %s (exp − iat), over the peer's maxTokenAge %s", age, maxAge)
	}
	k := c.Kubernetes
	if k == nil || k.ServiceAccount == nil || k.Namespace == "" || k.ServiceAccount.Name == "" || k.ServiceAccount.UID == "" {
		return WorkloadClaims{}, tokenErr(TokenMissingClaims, "kubernetes.io namespace and serviceaccount name and uid are required")
	}
	if len(validation.IsDNS1123Label(k.Namespace)) > 0 || len(validation.IsDNS1123Subdomain(k.ServiceAccount.Name)) > 0 || len(k.ServiceAccount.UID) > 64 {
		return WorkloadClaims{}, tokenErr(TokenMissingClaims, "kubernetes.io namespace or serviceaccount is not a valid name")
	}
	user := "system:serviceaccount:" + k.Namespace + ":" + k.ServiceAccount.Name
	if c.Subject != user {
		return WorkloadClaims{}, tokenErr(TokenMissingClaims, "sub does not name the kubernetes.io serviceaccount")
	}
	out := WorkloadClaims{
		Namespace:          k.Namespace,
		ServiceAccount:     k.ServiceAccount.Name,
		ServiceAccountUID:  k.ServiceAccount.UID,
		JTI:                c.ID,
		KeyID:              keyID,
		IssuedAt:           c.IssuedAt.UTC(),
		Expires:            c.ExpiresAt.UTC(),
		BoundToSecret:      k.Secret != nil,
		BoundToNode:        k.Node != nil,
		ServiceAccountUser: user,
	}
	if k.Pod != nil && k.Pod.Name != "" && k.Pod.UID != "" {
		out.BoundToPod, out.Pod, out.PodUID = true, k.Pod.Name, k.Pod.UID
	}
	if o.RequirePodBinding && !out.BoundToPod {
		return WorkloadClaims{}, tokenErr(TokenPodBindingNeeded, "the peer requires pod-bound tokens (a projected token), this one is not bound to a pod")
	}
	return out, nil
}

// classifyJWTError turns golang-jwt's error into a reason code.
func classifyJWTError(tok *jwt.Token, err error) *WorkloadTokenError {
	alg := ""
	if tok != nil && tok.Header != nil {
		alg, _ = tok.Header["alg"].(string)
	}
	allowed := alg == jwt.SigningMethodRS256.Alg() || alg == jwt.SigningMethodES256.Alg()
	switch {
	case errors.Is(err, jwt.ErrTokenMalformed):
		return &WorkloadTokenError{Reason: TokenMalformed, Err: err}
	case !allowed && (errors.Is(err, jwt.ErrTokenSignatureInvalid) || errors.Is(err, jwt.ErrTokenUnverifiable)):
		// alg none, HS256 (the public key as an HMAC secret), RS512…
		return tokenErr(TokenUnsupportedAlg, "alg %q is not RS256 or ES256", clip(alg))
	case errors.Is(err, errUnknownKey):
		return &WorkloadTokenError{Reason: TokenUnknownKey, Err: err}
	case errors.Is(err, jwt.ErrTokenSignatureInvalid):
		return &WorkloadTokenError{Reason: TokenBadSignature, Err: err}
	case errors.Is(err, jwt.ErrTokenExpired):
		return &WorkloadTokenError{Reason: TokenExpired, Err: err}
	case errors.Is(err, jwt.ErrTokenNotValidYet), errors.Is(err, jwt.ErrTokenUsedBeforeIssued):
		return &WorkloadTokenError{Reason: TokenNotYetValid, Err: err}
	case errors.Is(err, jwt.ErrTokenInvalidAudience):
		return &WorkloadTokenError{Reason: TokenWrongAudience, Err: err}
	case errors.Is(err, jwt.ErrTokenInvalidIssuer):
		return &WorkloadTokenError{Reason: TokenWrongIssuer, Err: err}
	case errors.Is(err, jwt.ErrTokenRequiredClaimMissing), errors.Is(err, jwt.ErrTokenInvalidClaims):
		return &WorkloadTokenError{Reason: TokenMissingClaims, Err: err}
	}
	return &WorkloadTokenError{Reason: TokenMalformed, Err: err}
}

// clip keeps an attacker-chosen header value short in a log line.
func clip(s string) string {
	if len(s) > 16 {
		return s[:16] + "…"
	}
	return s
}
