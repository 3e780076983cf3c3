// Package client is the Go client of the tokenbroker API, used by the
// agent, by "tokenbroker get kubeconfig" and "tokenbroker enroll", and by
// the tests. It speaks the wire types of api/v1 over the TLS profiles of
// the pki package, and turns problem+json answers into *ProblemError.
package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// maxResponseBytes bounds what the client reads from a broker; a
// kubeconfig or a certificate chain is a few kilobytes.
const maxResponseBytes = 1 << 20

// Config says where the broker is and how to authenticate to it.
type Config struct {
	// URL is the broker's base URL, e.g. https://east.example.com:8443.
	URL string
	// RootCAs verifies the broker's certificate. Required: the client never
	// falls back to the system roots or to no verification.
	RootCAs *x509.CertPool
	// VerifyConnection, if set, is a further check of every handshake
	// after the standard verification against RootCAs (hostname
	// included), never in place of it: the agent uses it to make a pinned
	// CA the only root (pki.VerifyChainToPinned).
	VerifyConnection func(tls.ConnectionState) error
	// Certificate is the client certificate; nil for enrollment with a join
	// token, which goes to the broker's enrollment listener.
	Certificate *pki.CertReloader
	// GetClientCertificate, used when Certificate is nil, returns the client
	// certificate on every handshake from wherever the caller keeps it (the
	// agent keeps its key pair in memory, whether it stores it in files or
	// in a Kubernetes Secret). Setting both is an error.
	GetClientCertificate func(*tls.CertificateRequestInfo) (*tls.Certificate, error)
	// Timeout bounds each request; default 30s.
	Timeout time.Duration
	// IdleConnTimeout is how long a kept-alive connection may stay idle
	// before it is closed; default 90s. A caller whose requests come
	// minutes apart (the agent) sets it short: an idle connection holds two
	// goroutines and its TLS and buffer state on both ends for nothing.
	IdleConnTimeout time.Duration
	// WorkloadToken, if set, returns the workload token (a ServiceAccount
	// token of this cluster with the broker's audience) sent as the bearer
	// token of kubeconfig, lease and whoami requests, so that the broker
	// knows which workload asks. It is called for every request, so a
	// projected token that the kubelet rotates is always fresh
	// (WorkloadTokenFile).
	WorkloadToken func() (string, error)
}

// WorkloadTokenFile returns a Config.WorkloadToken that reads the token
// from path at every call (at most pki.MaxWorkloadTokenBytes, surrounding
// white space removed): the kubelet rewrites a projected token in place.
func WorkloadTokenFile(path string) func() (string, error) {
	return func() (string, error) {
		data, err := pki.ReadFileLimit(path, pki.MaxWorkloadTokenBytes+2)
		if err != nil {
			return "", fmt.Errorf("read workload token: %w", err)
		}
		token := strings.TrimSpace(string(data))
		if token == "" || len(token) > pki.MaxWorkloadTokenBytes {
			return "", fmt.Errorf("workload token file %s is empty or longer than %d bytes", path, pki.MaxWorkloadTokenBytes)
		}
		return token, nil
	}
}

// Client calls one broker. It keeps connections alive and is safe for
// concurrent use.
type Client struct {
	base     *url.URL
	http     *http.Client
	workload func() (string, error)
}

// New returns a Client for cfg.
func New(cfg Config) (*Client, error) {
	u, err := parseBrokerURL(cfg.URL)
	if err != nil {
		return nil, err
	}
	if cfg.RootCAs == nil {
		return nil, errors.New("client: RootCAs is required")
	}
	if cfg.Certificate != nil && cfg.GetClientCertificate != nil {
		return nil, errors.New("client: set Certificate or GetClientCertificate, not both")
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 30 * time.Second
	}
	if cfg.IdleConnTimeout == 0 {
		cfg.IdleConnTimeout = defaultIdleConnTimeout
	}
	tc := pki.ClientTLSConfig(cfg.RootCAs, cfg.Certificate)
	if cfg.GetClientCertificate != nil {
		tc.GetClientCertificate = cfg.GetClientCertificate
	}
	tc.VerifyConnection = cfg.VerifyConnection
	return &Client{base: u, workload: cfg.WorkloadToken, http: &http.Client{
		Timeout:   cfg.Timeout,
		Transport: newTransport(tc, cfg.IdleConnTimeout),
	}}, nil
}

// defaultIdleConnTimeout is Config.IdleConnTimeout's default.
const defaultIdleConnTimeout = 90 * time.Second

func newTransport(tc *tls.Config, idle time.Duration) *http.Transport {
	return &http.Transport{
		TLSClientConfig:       tc,
		ForceAttemptHTTP2:     true,
		MaxIdleConnsPerHost:   16,
		IdleConnTimeout:       idle,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 30 * time.Second,
	}
}

func parseBrokerURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "https" || u.Host == "" || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return nil, fmt.Errorf("client: broker URL %q must be https://host[:port]", s)
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	return u, nil
}

// CloseIdleConnections closes kept-alive connections, e.g. after the
// client certificate was renewed so that new connections present it.
func (c *Client) CloseIdleConnections() { c.http.CloseIdleConnections() }

// ProblemError is a problem+json answer of the broker.
type ProblemError struct {
	Status  int
	Problem apiv1.Problem
	// RetryAfter is the broker's Retry-After, if it sent one.
	RetryAfter time.Duration
}

func (e *ProblemError) Error() string {
	msg := e.Problem.Title
	if e.Problem.Detail != "" {
		msg += ": " + e.Problem.Detail
	}
	for _, f := range e.Problem.Errors {
		msg += fmt.Sprintf("; %s: %s", f.Field, f.Detail)
	}
	if e.Problem.Reason != "" {
		msg += " (reason: " + e.Problem.Reason + ")"
	}
	return fmt.Sprintf("broker answered %d: %s", e.Status, msg)
}

// Retryable reports whether err may go away by itself: a transport error,
// a 5xx or a 429. A 4xx other than 429 will not, nor a client certificate
// the broker refused in the handshake (ErrCertificateRefused).
func Retryable(err error) bool {
	if err == nil {
		return false
	}
	var pe *ProblemError
	if errors.As(err, &pe) {
		return pe.Status >= 500 || pe.Status == http.StatusTooManyRequests
	}
	// A broker that fails verification (a wrong pin, a certificate from
	// another CA) will not pass it by being asked again.
	var verr *tls.CertificateVerificationError
	var uerr x509.UnknownAuthorityError
	var herr x509.HostnameError
	if errors.Is(err, pki.ErrFingerprintMismatch) || errors.Is(err, ErrCertificateRefused) || errors.As(err, &verr) || errors.As(err, &uerr) || errors.As(err, &herr) {
		return false
	}
	return !errors.Is(err, context.Canceled)
}

// Kubeconfig asks for a kubeconfig. The answer holds a credential: never
// log it.
func (c *Client) Kubeconfig(ctx context.Context, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
	var out apiv1.KubeconfigResponse
	if err := c.doAs(ctx, http.MethodPost, "/v1/kubeconfigs", req, http.StatusCreated, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ExecKubeconfig asks for the kubeconfig of POST
// /v1/kubeconfigs?format=exec: authorized like Kubeconfig, but nothing is
// issued, and its user runs the exec credential plugin. It holds no
// credential; its cluster entry is the one the broker's kubeconfigs name.
func (c *Client) ExecKubeconfig(ctx context.Context, req apiv1.KubeconfigRequest) ([]byte, error) {
	var out apiv1.ExecKubeconfigResponse
	if err := c.do(ctx, http.MethodPost, "/v1/kubeconfigs?format=exec", "", req, http.StatusOK, &out); err != nil {
		return nil, err
	}
	return []byte(out.Kubeconfig), nil
}

// Leases lists all the caller's leases, following the broker's continue
// tokens page by page (LeasePages).
func (c *Client) Leases(ctx context.Context) ([]apiv1.Lease, error) {
	var out []apiv1.Lease
	err := c.LeasePages(ctx, func(page []apiv1.Lease) error {
		out = append(out, page...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if out == nil {
		out = []apiv1.Lease{}
	}
	return out, nil
}

// LeasePages calls fn with each page of the caller's leases (GET
// /v1/leases with the broker's default page size) until the broker sends
// no continue token, fn fails, or a request does. A broker that answers
// the token it was given is an error, not an endless walk.
func (c *Client) LeasePages(ctx context.Context, fn func([]apiv1.Lease) error) error {
	token := ""
	for {
		path := "/v1/leases"
		if token != "" {
			path += "?continue=" + url.QueryEscape(token)
		}
		var page apiv1.LeaseList
		if err := c.doAs(ctx, http.MethodGet, path, nil, http.StatusOK, &page); err != nil {
			return err
		}
		if err := fn(page.Items); err != nil {
			return err
		}
		switch page.Continue {
		case "":
			return nil
		case token:
			return errors.New("list leases: the broker answered the continue token it was given")
		}
		token = page.Continue
	}
}

// RevokeLease revokes one of the caller's leases.
func (c *Client) RevokeLease(ctx context.Context, id string) error {
	return c.doAs(ctx, http.MethodDelete, "/v1/leases/"+url.PathEscape(id), nil, http.StatusNoContent, nil)
}

// WhoAmI returns the caller's identity and grants as the broker sees them.
func (c *Client) WhoAmI(ctx context.Context) (*apiv1.WhoAmI, error) {
	var out apiv1.WhoAmI
	if err := c.doAs(ctx, http.MethodGet, "/v1/whoami", nil, http.StatusOK, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// PutJWKS uploads this cluster's service-account key set (the document
// served at /openid/v1/jwks) for the broker to verify workload tokens with.
func (c *Client) PutJWKS(ctx context.Context, doc []byte) (*apiv1.PeerJWKS, error) {
	var out apiv1.PeerJWKS
	if err := c.do(ctx, http.MethodPut, "/v1/peers/self/jwks", "", json.RawMessage(doc), http.StatusOK, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// PutPods reports the uids of the Pods that live in this cluster
// (workloadIdentity.livePodsFromPeer).
func (c *Client) PutPods(ctx context.Context, uids []string) (*apiv1.PeerLivePods, error) {
	var out apiv1.PeerLivePods
	if err := c.do(ctx, http.MethodPut, "/v1/peers/self/pods", "", apiv1.LivePodsReport{UIDs: uids}, http.StatusOK, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// doAs is do with the workload token, if the client has one.
func (c *Client) doAs(ctx context.Context, method, path string, in any, want int, out any) error {
	bearer := ""
	if c.workload != nil {
		t, err := c.workload()
		if err != nil {
			return err
		}
		bearer = t
	}
	return c.do(ctx, method, path, bearer, in, want, out)
}

// Renew asks for a new client certificate for the caller's own identity
// (req.CSR) and, with req.ClusterCACSR, a new cluster CA. The answer
// holds no key.
func (c *Client) Renew(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	var out apiv1.CertificateResponse
	err := c.do(ctx, http.MethodPost, "/v1/certificates", "", req, http.StatusCreated, &out)
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// Enroll exchanges a join token and req (a CSR and, with ClusterCACSR,
// the cluster CA's) for a first client certificate (and cluster CA). The
// client must point at the broker's enrollment listener.
func (c *Client) Enroll(ctx context.Context, joinToken string, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	var out apiv1.CertificateResponse
	err := c.do(ctx, http.MethodPost, "/v1/certificates", joinToken, req, http.StatusCreated, &out)
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// TrustBundle returns the broker's CA bundle.
func (c *Client) TrustBundle(ctx context.Context) (*apiv1.TrustBundle, error) {
	var out apiv1.TrustBundle
	if err := c.do(ctx, http.MethodGet, "/v1/trust-bundle", "", nil, http.StatusOK, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

func (c *Client) do(ctx context.Context, method, path, bearer string, in any, want int, out any) error {
	return roundTrip(ctx, c.http, method, c.base.String()+path, bearer, in, want, out)
}

func roundTrip(ctx context.Context, hc *http.Client, method, u, bearer string, in any, want int, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("encode request: %w", err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return fmt.Errorf("build request: %w", err)
	}
	req.Header.Set("Accept", apiv1.MediaTypeJSON)
	if in != nil {
		req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	var serverVerified atomic.Bool
	req = req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		TLSHandshakeDone: func(st tls.ConnectionState, err error) {
			if err == nil && len(st.VerifiedChains) > 0 {
				serverVerified.Store(true)
			}
		},
		GotConn: func(info httptrace.GotConnInfo) {
			if tc, ok := info.Conn.(*tls.Conn); ok && len(tc.ConnectionState().VerifiedChains) > 0 {
				serverVerified.Store(true)
			}
		},
	}))
	resp, err := hc.Do(req)
	if err != nil {
		if serverVerified.Load() && remoteRefusalAlert(err) {
			return fmt.Errorf("%s %s: %w: %w", method, req.URL.Path, ErrCertificateRefused, err)
		}
		return fmt.Errorf("%s %s: %w", method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes+1))
	if err != nil {
		return fmt.Errorf("%s %s: read answer: %w", method, req.URL.Path, err)
	}
	if len(raw) > maxResponseBytes {
		return fmt.Errorf("%s %s: answer over %d bytes", method, req.URL.Path, maxResponseBytes)
	}
	if resp.StatusCode != want {
		pe := &ProblemError{Status: resp.StatusCode}
		if json.Unmarshal(raw, &pe.Problem) != nil || pe.Problem.Title == "" {
			pe.Problem.Title = http.StatusText(resp.StatusCode)
		}
		if s := resp.Header.Get("Retry-After"); s != "" {
			if secs, err := time.ParseDuration(s + "s"); err == nil {
				pe.RetryAfter = secs
			}
		}
		return pe
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return fmt.Errorf("%s %s: decode answer: %w", method, req.URL.Path, err)
		}
	}
	return nil
}
