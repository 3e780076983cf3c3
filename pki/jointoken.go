package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"
)

// Join tokens authorize a new cluster's first certificate (enrollment): an
// operator runs `tokenbroker pki join-token`, hands the token to the joining
// cluster out of band, and the broker accepts it once on its enrollment
// listener as the bearer of POST /v1/certificates.
//
// A join token is a JWT signed ES256 by the key of the CA that signs client
// certificates, so the broker needs no extra secret: it verifies with the CA
// certificate it already has.
const (
	// JoinTokenIssuer is the iss claim of every join token.
	JoinTokenIssuer = "tokenbroker-pki"
	// JoinTokenAudience is the aud claim of an unbound join token, one
	// made without JoinTokenOptions.Audiences (as every release before
	// audiences made them): any broker of the CA would take it, so brokers
	// accept it only when told to (serve --accept-unbound-join-tokens).
	JoinTokenAudience = "tokenbroker-enrollment"
	// MaxJoinTokenAudiences and MaxJoinTokenAudienceBytes bound the
	// brokers one token may name and the length of each name.
	MaxJoinTokenAudiences     = 16
	MaxJoinTokenAudienceBytes = 253
	// MaxJoinTokenBytes bounds a join token before it is parsed. Real
	// ones are about 400 bytes.
	MaxJoinTokenBytes = 4096
	// DefaultJoinTokenTTL is the lifetime of a join token when
	// JoinTokenOptions.TTL is zero: long enough to paste it, short enough
	// that a leaked one is soon useless.
	DefaultJoinTokenTTL = 10 * time.Minute
	// MaxJoinTokenTTL is the longest lifetime a join token may have, at
	// issuance and at verification.
	MaxJoinTokenTTL = 24 * time.Hour
	// JoinTokenLeeway is the clock skew JoinTokenVerifier tolerates on exp,
	// nbf and iat.
	JoinTokenLeeway = 30 * time.Second
)

// ErrInvalidJoinToken is wrapped by every error of JoinTokenVerifier.Verify.
// The broker answers every one of them the same way (401); the wrapped cause
// is for the log and never contains the token. Not retryable with the same
// token.
var ErrInvalidJoinToken = errors.New("invalid join token")

// joinTokenIDBytes is the size of a jti: 128 random bits.
const joinTokenIDBytes = 16

// JoinTokenOptions describes a join token.
type JoinTokenOptions struct {
	// Identity is the cluster identity the token lets its bearer enroll as,
	// spiffe://<trust-domain>/cluster/<name> (the sub claim).
	Identity string
	// Audiences are the brokers the token is for (its aud claim), by the
	// names they answer to (serve --broker-name, by default the policy's
	// cluster.name): a broker refuses a token that does not name it, so a
	// token cannot be replayed at another broker of the same CA. Empty
	// makes an unbound token (aud JoinTokenAudience).
	Audiences []string
	// TTL is how long the token is valid; zero means DefaultJoinTokenTTL,
	// more than MaxJoinTokenTTL is refused.
	TTL time.Duration
	// Now is the clock; nil means the CA's.
	Now func() time.Time
	// Rand is the source of the token ID; nil means the CA's.
	Rand io.Reader
}

// JoinTokenClaims are the claims of a join token that matter to the broker.
type JoinTokenClaims struct {
	// Identity is the cluster identity (sub).
	Identity string
	// ID is the token's unique ID (jti): 32 lowercase hex digits (128 random
	// bits), usable as a Kubernetes object name or label value. The broker
	// records it to refuse a second use and logs it instead of the token.
	ID string
	// Audiences is aud: the brokers the token is for, or
	// [JoinTokenAudience] for an unbound token.
	Audiences []string
	// IssuedAt, NotBefore and ExpiresAt are iat, nbf and exp, in UTC at
	// the second precision of JWT.
	IssuedAt, NotBefore, ExpiresAt time.Time
}

// joinClaims is the JWT body.
type joinClaims struct {
	jwt.RegisteredClaims
}

// IssueJoinToken makes a join token for opts.Identity, signed ES256 by the
// CA's key, which must therefore be ECDSA P-256 (every CA this package makes
// is). It returns the token, a secret to hand to the joining cluster only,
// and its claims, which are safe to log.
func (ca *CA) IssueJoinToken(opts JoinTokenOptions) (string, JoinTokenClaims, error) {
	if _, _, err := ParseIdentity(opts.Identity); err != nil {
		return "", JoinTokenClaims{}, fmt.Errorf("issue join token: %w", err)
	}
	aud, err := joinTokenAudiences(opts.Audiences)
	if err != nil {
		return "", JoinTokenClaims{}, fmt.Errorf("issue join token: %w", err)
	}
	ttl := opts.TTL
	if ttl == 0 {
		ttl = DefaultJoinTokenTTL
	}
	if ttl < 0 || ttl > MaxJoinTokenTTL {
		return "", JoinTokenClaims{}, fmt.Errorf("issue join token: TTL %s is outside (0, %s]", ttl, MaxJoinTokenTTL)
	}
	key, ok := ca.signer.(*ecdsa.PrivateKey)
	if !ok || key.Curve != elliptic.P256() {
		return "", JoinTokenClaims{}, errors.New("issue join token: the CA key is not ECDSA P-256, which ES256 needs")
	}
	now, rnd := ca.now, ca.rand
	if opts.Now != nil {
		now = opts.Now
	}
	if opts.Rand != nil {
		rnd = opts.Rand
	}
	id := make([]byte, joinTokenIDBytes)
	if _, err := io.ReadFull(rnd, id); err != nil {
		return "", JoinTokenClaims{}, fmt.Errorf("issue join token: generate ID: %w", err)
	}
	t := now()
	iat := jwt.NewNumericDate(t)
	exp := jwt.NewNumericDate(t.Add(ttl))
	if exp.After(ca.cert.NotAfter) {
		// The token would outlive the key that vouches for it.
		return "", JoinTokenClaims{}, fmt.Errorf("issue join token: %w", ErrLifetimeExceedsCA)
	}
	claims := joinClaims{RegisteredClaims: jwt.RegisteredClaims{
		Issuer:    JoinTokenIssuer,
		Subject:   opts.Identity,
		Audience:  aud,
		ExpiresAt: exp,
		NotBefore: iat,
		IssuedAt:  iat,
		ID:        hex.EncodeToString(id),
	}}
	token, err := jwt.NewWithClaims(jwt.SigningMethodES256, claims).SignedString(key)
	if err != nil {
		return "", JoinTokenClaims{}, fmt.Errorf("issue join token: sign: %w", err)
	}
	return token, claims.public(), nil
}

// joinTokenAudiences checks the brokers a token names and returns its aud.
func joinTokenAudiences(names []string) (jwt.ClaimStrings, error) {
	if len(names) == 0 {
		return jwt.ClaimStrings{JoinTokenAudience}, nil
	}
	if len(names) > MaxJoinTokenAudiences {
		return nil, fmt.Errorf("%d audiences, at most %d", len(names), MaxJoinTokenAudiences)
	}
	out := make(jwt.ClaimStrings, 0, len(names))
	for _, n := range names {
		if err := ValidJoinTokenAudience(n); err != nil {
			return nil, err
		}
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out, nil
}

// ValidJoinTokenAudience checks one broker name of a join token's aud: 1
// to MaxJoinTokenAudienceBytes printable ASCII characters without spaces
// or commas, and not JoinTokenAudience (which marks an unbound token).
func ValidJoinTokenAudience(name string) error {
	if name == "" || len(name) > MaxJoinTokenAudienceBytes {
		return fmt.Errorf("audience %q: must be 1 to %d characters", name, MaxJoinTokenAudienceBytes)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' || c == ',' {
			return fmt.Errorf("audience %q: only printable ASCII without spaces or commas", name)
		}
	}
	if name == JoinTokenAudience {
		return fmt.Errorf("audience %q is the mark of an unbound token, not a broker name", name)
	}
	return nil
}

func (c *joinClaims) public() JoinTokenClaims {
	out := JoinTokenClaims{Identity: c.Subject, ID: c.ID, Audiences: slices.Clone([]string(c.Audience))}
	if c.IssuedAt != nil {
		out.IssuedAt = c.IssuedAt.UTC()
	}
	if c.NotBefore != nil {
		out.NotBefore = c.NotBefore.UTC()
	}
	if c.ExpiresAt != nil {
		out.ExpiresAt = c.ExpiresAt.UTC()
	}
	return out
}

// JoinTokenVerifier checks join tokens. It is safe for concurrent use.
//
// It does not know which tokens were used: a join token is single-use, and
// the broker enforces that by recording the token's ID (jti) in the
// Kubernetes API, where every replica sees it, before it signs anything.
type JoinTokenVerifier struct {
	// audiences counts the accepted audiences: with none, golang-jwt
	// would check no aud at all, so Verify refuses everything.
	audiences int
	keys      jwt.VerificationKeySet
	parser    *jwt.Parser
	now       func() time.Time
}

// NewJoinTokenVerifier returns a verifier of unbound join tokens (aud
// JoinTokenAudience) only; see NewJoinTokenVerifierFor.
func NewJoinTokenVerifier(keys []*x509.Certificate, now func() time.Time) *JoinTokenVerifier {
	return NewJoinTokenVerifierFor(keys, []string{JoinTokenAudience}, now)
}

// NewJoinTokenVerifierFor returns a verifier that accepts join tokens
// signed by the key of any of keys, the CA certificates whose keys may
// have signed join tokens (the current signing CA and, during a rotation,
// the previous one), whose aud names at least one of audiences: the
// broker's own names, and JoinTokenAudience if it takes unbound tokens.
// Certificates whose key is not ECDSA P-256 cannot have signed one and are
// skipped; with no usable key or no audience every token is refused. now
// nil means time.Now.
func NewJoinTokenVerifierFor(keys []*x509.Certificate, audiences []string, now func() time.Time) *JoinTokenVerifier {
	if now == nil {
		now = time.Now
	}
	v := &JoinTokenVerifier{now: now, audiences: len(audiences)}
	for _, c := range keys {
		if c == nil {
			continue
		}
		if pub, ok := c.PublicKey.(*ecdsa.PublicKey); ok && pub.Curve == elliptic.P256() {
			v.keys.Keys = append(v.keys.Keys, pub)
		}
	}
	v.parser = jwt.NewParser(
		// ES256 only: alg "none", HMAC keyed with the public key and
		// every other algorithm are refused before any key is tried.
		jwt.WithValidMethods([]string{jwt.SigningMethodES256.Alg()}),
		jwt.WithIssuer(JoinTokenIssuer),
		// Any one of the broker's names (golang-jwt refuses a token
		// without aud, and one naming none of them).
		jwt.WithAudience(audiences...),
		jwt.WithExpirationRequired(),
		jwt.WithIssuedAt(),
		jwt.WithLeeway(JoinTokenLeeway),
		jwt.WithTimeFunc(now),
		// One encoding per token: no padding, no non-canonical base64.
		jwt.WithStrictDecoding(),
	)
	return v
}

// Verify checks a join token and returns its claims. It refuses, with an
// error wrapping ErrInvalidJoinToken: a token longer than MaxJoinTokenBytes;
// a signature that is not ES256 by one of the verifier's keys; an iss other
// than JoinTokenIssuer; an aud that names none of the verifier's audiences
// (another broker's token, or an unbound one where unbound tokens are not
// taken); a missing or past exp; an
// nbf or iat in the future; an exp more than MaxJoinTokenTTL ahead; a sub
// that is not a cluster identity; a missing or malformed jti (clock checks
// allow JoinTokenLeeway). It does not check single use (see
// JoinTokenVerifier). The error never contains the token.
func (v *JoinTokenVerifier) Verify(token string) (JoinTokenClaims, error) {
	if len(token) > MaxJoinTokenBytes {
		return JoinTokenClaims{}, fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidJoinToken, len(token), MaxJoinTokenBytes)
	}
	if len(v.keys.Keys) == 0 {
		return JoinTokenClaims{}, fmt.Errorf("%w: no ECDSA P-256 CA key to verify with", ErrInvalidJoinToken)
	}
	if v.audiences == 0 {
		return JoinTokenClaims{}, fmt.Errorf("%w: this broker has no name to find in aud", ErrInvalidJoinToken)
	}
	var claims joinClaims
	_, err := v.parser.ParseWithClaims(token, &claims, func(*jwt.Token) (any, error) { return v.keys, nil })
	if err != nil {
		// golang-jwt's messages name the failed check, never the token.
		return JoinTokenClaims{}, fmt.Errorf("%w: %w", ErrInvalidJoinToken, err)
	}
	if _, _, err := ParseIdentity(claims.Subject); err != nil {
		return JoinTokenClaims{}, fmt.Errorf("%w: sub: %w", ErrInvalidJoinToken, err)
	}
	if !isTokenID(claims.ID) {
		return JoinTokenClaims{}, fmt.Errorf("%w: jti missing or not 32 lowercase hex digits", ErrInvalidJoinToken)
	}
	if claims.ExpiresAt.Sub(v.now()) > MaxJoinTokenTTL+JoinTokenLeeway {
		return JoinTokenClaims{}, fmt.Errorf("%w: exp more than %s ahead", ErrInvalidJoinToken, MaxJoinTokenTTL)
	}
	return claims.public(), nil
}

// isTokenID reports whether id has the form IssueJoinToken gives a jti, so
// that the broker may use it in an object name.
func isTokenID(id string) bool {
	if len(id) != 2*joinTokenIDBytes {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// ReadJoinToken reads a join token from a file, or from r for "-": the
// token without surrounding white space, at most MaxJoinTokenBytes. The
// agent and "tokenbroker enroll" read it with this.
func ReadJoinToken(name string, r io.Reader) (string, error) {
	var raw []byte
	var err error
	switch {
	case name == "-" && r == nil:
		return "", errors.New("read join token: no standard input here")
	case name == "-":
		raw, err = io.ReadAll(io.LimitReader(r, MaxJoinTokenBytes+2))
	default:
		raw, err = ReadFileLimit(name, MaxJoinTokenBytes+2)
	}
	if err != nil {
		return "", fmt.Errorf("read join token: %w", err)
	}
	token := strings.TrimSpace(string(raw))
	switch {
	case len(token) > MaxJoinTokenBytes:
		return "", fmt.Errorf("the join token in %s is over %d bytes", name, MaxJoinTokenBytes)
	case token == "":
		return "", fmt.Errorf("the join token in %s is empty", name)
	}
	return token, nil
}
