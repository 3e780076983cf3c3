package agent

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap/zapcore"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Credential is one kubeconfig obtained from a broker, with what the
// outputs need to render it. Kubeconfig and Token are secrets: String,
// GoString and the zap encoding show only the lease and its expiry, so
// that a Credential passed to a logger by mistake leaks nothing.
type Credential struct {
	// LeaseID names the lease at the broker, for revocation.
	LeaseID string
	// Kubeconfig is the kubeconfig as the broker built it.
	Kubeconfig []byte
	// Token is the bearer token inside Kubeconfig, for a token
	// credential; CertData and KeyData are the client certificate and key
	// (PEM) inside it, for a client-certificate credential.
	Token    string
	CertData []byte
	KeyData  []byte
	// Server is the API server URL of the kubeconfig's current context
	// (the lease gateway's, for a gateway lease), and CAData the PEM
	// bundle that verifies it. TLSServerName and
	// ProxyURL are its tls-server-name and proxy-url, if any.
	Server        string
	CAData        []byte
	TLSServerName string
	ProxyURL      string
	// ObtainedAt is when the answer arrived, ExpiresAt when the credential
	// expires; the granted lifetime is the difference.
	ObtainedAt time.Time
	ExpiresAt  time.Time
	// RequestedTTL, GrantedTTL and ClampedBy are the broker's account of
	// the lifetime (see apiv1.KubeconfigResponse).
	RequestedTTL string
	GrantedTTL   string
	ClampedBy    string
	// Access is the lease's mode as the broker answered it:
	// apiv1.AccessGateway when Server is the broker's lease gateway and the
	// credential a certificate for this one lease; empty or
	// apiv1.AccessDirect for a credential of the API server.
	Access string
}

// String describes the credential without its secrets.
func (c *Credential) String() string {
	if c == nil {
		return "<nil credential>"
	}
	return fmt.Sprintf("credential{lease %s, expires %s}", c.LeaseID, c.ExpiresAt.UTC().Format(time.RFC3339))
}

// GoString is String, so that %#v leaks nothing either.
func (c *Credential) GoString() string { return c.String() }

// MarshalLogObject logs the lease and its lifetime, never the token.
func (c *Credential) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	enc.AddString("lease_id", c.LeaseID)
	enc.AddTime("expires_at", c.ExpiresAt)
	enc.AddTime("obtained_at", c.ObtainedAt)
	return nil
}

// Response returns the credential as the API's wire type, for "tokenbroker
// get kubeconfig --format json". It holds the token.
func (c *Credential) Response() apiv1.KubeconfigResponse {
	return apiv1.KubeconfigResponse{
		LeaseID:      c.LeaseID,
		Kubeconfig:   string(c.Kubeconfig),
		Credential:   c.Kind(),
		Token:        c.Token,
		ExpiresAt:    c.ExpiresAt.UTC(),
		RequestedTTL: c.RequestedTTL,
		GrantedTTL:   c.GrantedTTL,
		ClampedBy:    c.ClampedBy,
		Access:       c.Access,
	}
}

// Kind is the credential kind of the kubeconfig's user.
func (c *Credential) Kind() string {
	if len(c.CertData) > 0 {
		return apiv1.CredentialClientCertificate
	}
	return apiv1.CredentialToken
}

func (c *Credential) grant() grant {
	return grant{leaseID: c.LeaseID, obtainedAt: c.ObtainedAt, expiresAt: c.ExpiresAt}
}

// KubeconfigAPI is the part of the broker API that Fetch needs;
// *client.Client implements it. WhoAmI tells a client certificate's peer
// name, from which the certificate's user name is made.
type KubeconfigAPI interface {
	Kubeconfig(ctx context.Context, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error)
	WhoAmI(ctx context.Context) (*apiv1.WhoAmI, error)
}

// ErrBadAnswer is wrapped when a broker's 201 answer cannot be used (no
// lease id, an unreadable kubeconfig, a credential already expired). Not
// retryable in itself, but the agent retries anyway: a broker may be
// fixed.
var ErrBadAnswer = errors.New("unusable answer from the broker")

// Fetch asks the broker for a kubeconfig and checks the answer: a lease id,
// a kubeconfig with a server, a CA bundle and a token, and an expiry after
// the moment the answer arrived (now()). It is the one fetch of the agent's
// refreshers and of "tokenbroker get kubeconfig". Errors of the broker
// client are wrapped (see client.Retryable).
//
// For a client certificate it makes a new key and sends a CSR for it (the
// user name comes from the peer name, asked with WhoAmI, and the key), so
// that the key never leaves this process; the broker's kubeconfig, which
// has no key then, gets it here. A gateway request does the same without
// WhoAmI: the broker signs a lease certificate for the CSR's key whatever
// its subject, and the kubeconfig's server is then the lease gateway.
func Fetch(ctx context.Context, api KubeconfigAPI, req config.RequestConfig, now func() time.Time) (*Credential, error) {
	apiReq := req.APIRequest()
	var keyPEM []byte
	switch {
	case req.Access == apiv1.AccessGateway:
		csrPEM, key, _, err := pki.NewUserCSR(func(crypto.PublicKey) (string, error) { return gatewayCSRSubject, nil }, nil)
		if err != nil {
			return nil, err
		}
		apiReq.CSR, keyPEM = string(csrPEM), key
	case req.Credential == apiv1.CredentialClientCertificate:
		who, err := api.WhoAmI(ctx)
		if err != nil {
			return nil, fmt.Errorf("request kubeconfig for %s: who am I: %w", req.Subject(), err)
		}
		if who.Peer == "" {
			return nil, fmt.Errorf("request kubeconfig for %s: the broker's policy does not know the identity %s", req.Subject(), who.Identity)
		}
		csrPEM, key, _, err := pki.NewUserCSR(func(pub crypto.PublicKey) (string, error) {
			return apiv1.CertificateUser(who.Peer, pub)
		}, nil)
		if err != nil {
			return nil, err
		}
		apiReq.CSR, keyPEM = string(csrPEM), key
	}
	resp, err := api.Kubeconfig(ctx, apiReq)
	if err != nil {
		return nil, fmt.Errorf("request kubeconfig for %s: %w", req.Subject(), err)
	}
	if req.Access != "" && resp.Access != "" && resp.Access != req.Access {
		// The outputs would point consumers at another place than the
		// configuration says (the gateway or the API server).
		return nil, fmt.Errorf("%w: lease %s: access %s was asked for, and the broker answered %s", ErrBadAnswer, resp.LeaseID, req.Access, resp.Access)
	}
	if keyPEM != nil {
		kc, err := withClientKey([]byte(resp.Kubeconfig), keyPEM)
		if err != nil {
			return nil, fmt.Errorf("%w: lease %s: %w", ErrBadAnswer, resp.LeaseID, err)
		}
		resp.Kubeconfig = string(kc)
	}
	return credentialFromResponse(resp, now())
}

// gatewayCSRSubject is the common name of the CSR of a gateway lease: the
// broker reads only its key and signature, and names the certificate after
// the lease itself.
const gatewayCSRSubject = "tokenbroker-gateway-lease"

// withClientKey adds the key to the current context's user of a kubeconfig
// that has its certificate but no key.
func withClientKey(data, keyPEM []byte) ([]byte, error) {
	return editCurrentUser(data, func(user *clientcmdapi.AuthInfo) error {
		if len(user.ClientCertificateData) == 0 || len(user.ClientKeyData) > 0 {
			return errors.New("the kubeconfig's user is not the certificate asked for, without a key")
		}
		user.ClientKeyData = keyPEM
		return nil
	})
}

// editCurrentUser loads a kubeconfig, lets edit change the user of its
// current context, and writes it again. Errors never quote the document.
func editCurrentUser(data []byte, edit func(*clientcmdapi.AuthInfo) error) ([]byte, error) {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return nil, errors.New("the kubeconfig does not parse")
	}
	ctx, ok := cfg.Contexts[cfg.CurrentContext]
	if !ok {
		return nil, errors.New("the kubeconfig has no current context")
	}
	user, ok := cfg.AuthInfos[ctx.AuthInfo]
	if !ok {
		return nil, errors.New("the kubeconfig's current context has no user")
	}
	if err := edit(user); err != nil {
		return nil, err
	}
	return clientcmd.Write(*cfg)
}

func credentialFromResponse(resp *apiv1.KubeconfigResponse, obtainedAt time.Time) (*Credential, error) {
	if !apiv1.ValidLeaseID(resp.LeaseID) {
		return nil, fmt.Errorf("%w: lease id %q is not a lease id", ErrBadAnswer, resp.LeaseID)
	}
	kc, err := parseKubeconfig([]byte(resp.Kubeconfig))
	if err != nil {
		return nil, fmt.Errorf("%w: lease %s: %w", ErrBadAnswer, resp.LeaseID, err)
	}
	if resp.Token != "" && resp.Token != kc.token {
		return nil, fmt.Errorf("%w: lease %s: the token differs from the kubeconfig's", ErrBadAnswer, resp.LeaseID)
	}
	if !resp.ExpiresAt.After(obtainedAt) {
		return nil, fmt.Errorf("%w: lease %s expired at %s, before it arrived", ErrBadAnswer, resp.LeaseID, resp.ExpiresAt.UTC().Format(time.RFC3339))
	}
	c := &Credential{
		LeaseID:      resp.LeaseID,
		ObtainedAt:   obtainedAt,
		ExpiresAt:    resp.ExpiresAt,
		RequestedTTL: resp.RequestedTTL,
		GrantedTTL:   resp.GrantedTTL,
		ClampedBy:    resp.ClampedBy,
		Access:       resp.Access,
	}
	c.setKubeconfig([]byte(resp.Kubeconfig), kc)
	return c, nil
}

// setKubeconfig sets the kubeconfig and what the outputs read of it.
func (c *Credential) setKubeconfig(raw []byte, kc kubeconfigParts) {
	c.Kubeconfig = raw
	c.Token, c.Server, c.CAData = kc.token, kc.server, kc.caData
	c.CertData, c.KeyData = kc.certData, kc.keyData
	c.TLSServerName, c.ProxyURL = kc.tlsServerName, kc.proxyURL
}

type kubeconfigParts struct {
	server        string
	caData        []byte
	tlsServerName string
	proxyURL      string
	token         string
	certData      []byte
	keyData       []byte
}

// parseKubeconfig reads the current context's server, CA bundle and
// credential: a token, or a client certificate and key (clientcmd's
// AuthInfo, inline data only).
// Errors never quote the document: it holds the token.
func parseKubeconfig(data []byte) (kubeconfigParts, error) {
	if len(data) == 0 {
		return kubeconfigParts{}, errors.New("no kubeconfig")
	}
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return kubeconfigParts{}, errors.New("the kubeconfig does not parse")
	}
	ctx, ok := cfg.Contexts[cfg.CurrentContext]
	if !ok {
		return kubeconfigParts{}, errors.New("the kubeconfig has no current context")
	}
	cluster, ok := cfg.Clusters[ctx.Cluster]
	if !ok || cluster.Server == "" {
		return kubeconfigParts{}, errors.New("the kubeconfig's current context has no server")
	}
	user, ok := cfg.AuthInfos[ctx.AuthInfo]
	cert := ok && len(user.ClientCertificateData) > 0 && len(user.ClientKeyData) > 0
	if !ok || user.Token == "" && !cert {
		return kubeconfigParts{}, errors.New("the kubeconfig's current context has no token")
	}
	return kubeconfigParts{
		server:        cluster.Server,
		caData:        cluster.CertificateAuthorityData,
		tlsServerName: cluster.TLSServerName,
		proxyURL:      cluster.ProxyURL,
		token:         user.Token,
		certData:      user.ClientCertificateData,
		keyData:       user.ClientKeyData,
	}, nil
}

// tokenIssuedAt reads the iat claim of a JWT without verifying it, for a
// credential found in an output that does not say when it was obtained.
func tokenIssuedAt(token string) (time.Time, bool) {
	claims, err := pki.UnverifiedClaims(token)
	if err != nil || claims.IssuedAt == nil || claims.IssuedAt.IsZero() {
		return time.Time{}, false
	}
	return claims.IssuedAt.Time, true
}
